"""Main-thread CPU time of the runtime's steps per decode token (thread clocks, so preemption by other
processes does not count): a diagnostic, not a benchmark. Default configuration at 25%, 2 held-out prompts
x 32 tokens of `moeinf bench e2e`'s workload. Wraps methods of ONE MoE instance; nested calls are counted
in each wrapper (`ahead` contains `ahead.chances` contains `ahead.learned`; `plan` contains
`plan.plan_batch`; `submit` and `demand` contain `make_room` and `tier.*`).

    python bench/results/2026-11-25b-e2e/plan_cpu.py
"""
import argparse, collections, time, torch
from pathlib import Path
from moeinf import MoE, OffloadConfig
from moeinf.bench import e2e
import moeinf.runtime.lookahead as rl
MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")
torch.set_num_threads(1)
w, _ = e2e.build_workload(MODEL, argparse.Namespace(warmup=1, prompts=2, eamc_prompts=1, seed=0, max_prompt_tokens=256, new_tokens=32))
moe = MoE(MODEL, OffloadConfig(device_cache="25%", offload_dir=str(MODEL.with_name(MODEL.name + ".moeinf")), eamc=str(MODEL.with_name(MODEL.name + ".eamc"))))
w.decode(moe.generate, w.warm)
off = moe._runtime.offloader; cache = moe._runtime.cache; la = off.lookahead
sums = collections.Counter(); calls = collections.Counter(); on = {"d": False}
def wrap(obj, name, label):
    fn = getattr(obj, name)
    def f(*a, **k):
        t = time.thread_time()
        try: return fn(*a, **k)
        finally:
            if on["d"]:
                sums[label] += time.thread_time() - t; calls[label] += 1
    setattr(obj, name, f)
rlay = off.run_layer
def spy(layer, h, *r):
    on["d"] = h.shape[0] == 1
    if on["d"] and layer == 0: sums["tokens"] += 1
    return rlay(layer, h, *r)
off.run_layer = spy
wrap(la, "chances", "ahead.chances")
wrap(la.learned, "chances", "ahead.learned")
wrap(off, "_matchers", "plan.matchers")
wrap(off.prefetch_policy, "plan_batch", "plan.plan_batch")
wrap(off, "_plan", "plan")
wrap(off, "_ahead", "ahead")
wrap(off, "_paced", "paced")
wrap(cache, "prefetch", "submit")
wrap(cache.tier, "submit", "tier.submit")
wrap(cache.tier, "cancel", "tier.cancel")
wrap(cache.tier, "is_resident", "tier.is_resident")
wrap(cache.tier, "release", "tier.release")
wrap(cache, "_make_room", "make_room")
wrap(off, "_held", "held")
wrap(off, "_context", "context")
wrap(off, "_record", "record")
wrap(cache, "demand", "demand")
w.decode(moe.generate, w.inputs)
moe.close()
n = sums.pop("tokens")
for k, v in sorted(sums.items(), key=lambda kv: -kv[1]):
    print(f"{k:>18} {v/n*1e3:6.3f} ms/token  {calls[k]/n:5.2f} calls/token  {v/max(calls[k],1)*1e6:7.1f} us/call")
