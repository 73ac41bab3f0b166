"""Decode step with a wave's experts one per thread inside `gated_rows` against each product split between the
threads (the wave handed over one expert at a time), alternating in one process; medians of the rounds' ratios.

    T=2 python ab_threads.py .moeinf-int4 ROUNDS"""
import os, sys, time, statistics, torch
from pathlib import Path
from transformers import DynamicCache
from moeinf import MoE, OffloadConfig
from moeinf.bench.quant import speed_inputs
from moeinf.runtime import gemv, quant_compute
torch.set_num_threads(int(os.environ.get("T", "2")))
MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")
store = MODEL.with_name(MODEL.name + sys.argv[1]); rounds = int(sys.argv[2])
ids = speed_inputs(MODEL, 1)[0]
MODE = {"split": False}
real = gemv.gated_rows
def patched(x, experts, weights, out):
    if MODE["split"]:
        for e in experts:
            real(x, [e], weights, out)
    else:
        real(x, experts, weights, out)
quant_compute.gemv.gated_rows = patched
with MoE(MODEL, OffloadConfig(offload_dir=str(store), device_cache="100%", prefetch="none")) as moe, torch.inference_mode():
    model = moe.model
    moe.generate(ids, max_new_tokens=4, do_sample=False)
    steps = {"split each product": [], "one expert per thread": []}
    for _ in range(rounds):
        for name in steps:
            MODE["split"] = name == "split each product"
            cache = DynamicCache(config=model.config)
            token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            t = time.perf_counter()
            for _ in range(24):
                token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            steps[name].append((time.perf_counter() - t) / 24 * 1e3)
    a, b = steps.values()
    r = statistics.median(y / x for x, y in zip(a, b))
    print(sys.argv[1], {k: round(statistics.median(v), 2) for k, v in steps.items()}, "per-thread/split", round(r, 3))
