"""Scratch: issue 40's target per cell for fit variants (only the fitted policy re-replayed)."""

import json
import os
import sys
import time
from pathlib import Path

from moeinf.bench.cache import FRACTIONS, busiest_layer, load_workload, split
from moeinf.policy.fitted import GRID, FittedEviction, access_counts, fit_eviction, request_counts
from moeinf.policy.simulate import Accesses, simulate

SH = os.environ["SHARED"] + "/data/traces/"
RES = Path(__file__).resolve().parents[2] / "2026-11-30-first-use"
trace, top1, seed, variant = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4]
files = {
    "dsv2lite": SH + "dsv2lite-puffin-700.jsonl.gz",
    "gptoss20b": SH + "gptoss20b-fingerprint-400.jsonl.gz",
}
wl = load_workload(files[trace], quick=False, seed=seed, top1=top1)
ev, hist = split(len(wl.traces), 0.25, seed)
rep = [wl.traces[i] for i in ev]
H = [wl.traces[i] for i in hist]
counts, firsts = access_counts(H), request_counts(H)
acc = Accesses.of(rep)
total = wl.num_layers * wl.num_experts
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
