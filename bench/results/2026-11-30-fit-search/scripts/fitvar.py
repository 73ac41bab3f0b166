"""Scratch: issue 40's target per cell for fit variants (only the fitted policy re-replayed)."""

import json
import sys
import time

from cell import RES, load_cell

from moeinf.bench.cache import FRACTIONS, busiest_layer
from moeinf.policy.fitted import GRID, FittedEviction, fit_eviction
from moeinf.policy.simulate import simulate

trace, top1, seed, variant = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4]
wl, rep, H, counts, firsts, acc, total = load_cell(trace, top1, seed)
caps = [max(busiest_layer(rep), round(f * total)) for f in FRACTIONS]
kw = {}
if variant == "p2":
    kw["passes"] = 2
if variant == "fufirst":
    kw["grid"] = {"first_use": GRID["first_use"], **{k: v for k, v in GRID.items() if k != "first_use"}}
if variant.startswith("acc"):
    kw["max_accesses"] = int(variant[3:]) * 1000
if variant == "p2fu":
    kw["passes"] = 2
    kw["grid"] = {"first_use": GRID["first_use"], **{k: v for k, v in GRID.items() if k != "first_use"}}
if variant == "hz":
    kw["grid"] = {**GRID, "horizon": (0.0, 64.0, 256.0, 1024.0, 4096.0)}
t = time.perf_counter()
fit = fit_eviction(H, capacities=caps, seed=seed, **kw)
ft = time.perf_counter() - t
name = f"{trace}{'-top1' if top1 else ''}-seed{seed}.jsonl"
rows = [json.loads(l) for l in (RES / name).read_text().splitlines() if l.strip()]
out = []
for cap in caps:
    p = FittedEviction(wl.num_layers, wl.num_experts, fit)
    p.set_capacity(cap)
    r = simulate(acc, cap, p, counts=counts, firsts=firsts)
    pol = {row["policy"]: row for row in rows if row.get("capacity") == cap}
    n = pol["lru"]["hits"] + pol["lru"]["misses"]
    ratio = {k: v["hits"] / n for k, v in pol.items()}
    best = max(ratio["lru"], ratio["lfu"])
    target = max(best + min(0.03, (ratio["oracle"] - best) / 3), ratio["activation-aware"] - 0.01)
    out.append(
        {
            "cap": cap,
            "fitted": r.hits / n,
            "old": ratio["fitted"],
            "target": target,
            "met": r.hits / n >= target,
        }
    )
print(
    json.dumps(
        {
            "trace": trace,
            "top1": top1,
            "seed": seed,
            "variant": variant,
            "fit_s": round(ft, 1),
            "cand": fit.meta["candidates"],
            "cells": out,
        }
    )
)
