"""Scratch: on one cell, vary one new constant around the EAMC-side fit's setting; eval-side hits vs target."""

import dataclasses
import json
import sys
from concurrent.futures import ThreadPoolExecutor

from cell import RES, load_cell

from moeinf.bench.cache import FRACTIONS, busiest_layer
from moeinf.policy.fitted import FittedEviction, Setting
from moeinf.policy.simulate import simulate

trace, top1, seed = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
fracs = [float(x) for x in sys.argv[4].split(",")]
name, values = sys.argv[5], [float(x) for x in sys.argv[6].split(",")]
wl, rep, H, counts, firsts, acc, total = load_cell(trace, top1, seed)
rows = [
    json.loads(l)
    for l in (RES / f"{trace}{'-top1' if top1 else ''}-seed{seed}.jsonl").read_text().splitlines()
    if l.strip()
]
fit = rows[0]["fit"]
for frac in fracs:
    i = min(range(len(FRACTIONS)), key=lambda j: abs(FRACTIONS[j] - frac))
    cap = max(busiest_layer(rep), round(FRACTIONS[i] * total))
    r = fit["rows"][i]
    base = Setting(**{k: v for k, v in r.items() if k in Setting.__dataclass_fields__})
    pol = {row["policy"]: row for row in rows if row["capacity"] == cap}
    n = pol["lru"]["hits"] + pol["lru"]["misses"]
    ratio = {k: v["hits"] / n for k, v in pol.items()}
    best = max(ratio["lru"], ratio["lfu"])
    target = max(best + min(0.03, (ratio["oracle"] - best) / 3), ratio["activation-aware"] - 0.01)

    def run(v):
        p = FittedEviction(wl.num_layers, wl.num_experts, top_k=fit["top_k"])
        p.use(dataclasses.replace(base, **{name: v}))
        return simulate(acc, cap, p, counts=counts, firsts=firsts).hits / n

    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(run, values))
    print(
        trace,
        top1,
        seed,
        frac,
        "old",
        round(100 * (ratio["fitted"] - target), 3),
        " ".join(f"{v:g}:{100 * (g - target):+.3f}" for v, g in zip(values, got)),
        flush=True,
    )
