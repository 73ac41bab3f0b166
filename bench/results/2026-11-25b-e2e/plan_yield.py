"""Which layer's prefetch plan issues the reads that decode steps use: a diagnostic, not a benchmark.

Runs 2 held-out prompts x 32 tokens of `moeinf bench e2e`'s workload through the default configuration at
25% and, per decode token, counts the look-ahead plans made at each MoE layer and the reads each plan
issued, by the layer they are for (the first-layer guess off the logits is "guess"), how many were used,
and how many were still in flight when used ("late"). Wraps methods of ONE MoE instance.

    python bench/results/2026-11-25b-e2e/plan_yield.py
"""
import argparse, collections, time, torch
from pathlib import Path
from moeinf import MoE, OffloadConfig
from moeinf.bench import e2e
MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")
torch.set_num_threads(1)
w, _ = e2e.build_workload(MODEL, argparse.Namespace(warmup=1, prompts=2, eamc_prompts=1, seed=0, max_prompt_tokens=256, new_tokens=32))
moe = MoE(MODEL, OffloadConfig(device_cache="25%", offload_dir=str(MODEL.with_name(MODEL.name + ".moeinf")), eamc=str(MODEL.with_name(MODEL.name + ".eamc"))))
w.decode(moe.generate, w.warm)
off = moe._runtime.offloader; cache = moe._runtime.cache
st = {"d": False, "layer": None}
plans = collections.Counter(); issued = collections.Counter(); useful = collections.Counter(); late = collections.Counter()
origin = {}
rlay = off.run_layer
def spy(layer, h, *r):
    st["d"] = h.shape[0] == 1; st["layer"] = layer
    if st["d"] and layer == 0: plans["tokens"] += 1
    return rlay(layer, h, *r)
off.run_layer = spy
ahead = off._ahead
def spy_ahead(layer, *a):
    if st["d"]: plans[layer] += 1
    return ahead(layer, *a)
off._ahead = spy_ahead
pf = cache.prefetch
def spy_pf(plan, ctx, max_new=None):
    before = set(cache.in_flight)
    out = pf(plan, ctx, max_new)
    if st["d"]:
        src = "guess" if ctx.layer == off.num_layers - 1 and st.get("guessing") else ctx.layer
        for k in set(cache.in_flight) - before:
            origin[k] = (src, k[0]); issued[(src, k[0])] += 1
    return out
cache.prefetch = spy_pf
g = off.guess_first_layer
def spy_g(*a):
    st["guessing"] = True
    try: return g(*a)
    finally: st["guessing"] = False
off.guess_first_layer = spy_g
cnt = cache._count_access
def spy_cnt(key):
    if st["d"] and key in origin:
        src = origin.pop(key)
        useful[src] += 1
        if key not in cache.resident: late[src] += 1
    cnt(key)
cache._count_access = spy_cnt
w.decode(moe.generate, w.inputs)
moe.close()
n = plans.pop("tokens")
for src in list(range(8)) + ["guess"]:
    print(src, "plans/token", round(plans.get(src, 0)/n, 2))
    for key in sorted(k for k in issued if k[0] == src):
        print("   target layer", key[1], "issued/token", round(issued[key]/n, 2), "useful", round(useful[key]/n, 2), "late", round(late[key]/n, 2))
