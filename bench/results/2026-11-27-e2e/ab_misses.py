# needs plan-beside-misses.patch applied (an experiment, not committed): `_xp_misses` picks the rule per instance
# usage: python ab_misses.py misses,allres,nothread,misses,allres,nothread,misses,allres,nothread
import argparse, statistics, sys, torch
from pathlib import Path
from moeinf import MoE, OffloadConfig
from moeinf.bench import e2e
MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")
torch.set_num_threads(1)
workload, _ = e2e.build_workload(MODEL, argparse.Namespace(warmup=1, prompts=3, eamc_prompts=1, seed=0, max_prompt_tokens=64, new_tokens=32))
res = {}
for variant in sys.argv[1].split(","):
    moe = MoE(MODEL, OffloadConfig(device_cache="25%", offload_dir=str(MODEL.with_name(MODEL.name + ".moeinf")), eamc=str(MODEL.with_name(MODEL.name + ".eamc")), prefetch_plan_thread=variant != "nothread"))
    moe._runtime.offloader._xp_misses = variant == "misses"
    workload.decode(moe.generate, workload.warm)
    lat, _ = workload.decode(moe.generate, workload.inputs)
    m = statistics.median(lat) * 1e3
    res.setdefault(variant, []).append(round(m, 1))
    print(variant, round(m, 1), flush=True)
    moe.close()
print(res)
