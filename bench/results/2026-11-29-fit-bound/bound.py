"""How high can the fitted eviction family reach where issue 40's target is missed? Fit it on the evaluation
requests themselves (what no deployment can do: an upper bound for any fit of the family) and compare with
the target.

For one (trace, top-1 proxy or not, seed, cache fraction), with the split of `moeinf bench cache` (25% of
the requests replayed, the rest seeding the counts): replay LRU, LFU and Belady for the target; then run
the coordinate search of `fit_eviction` (two passes over `GRID`), scoring each candidate by its hits on the
replayed (evaluation) requests, from several starting points: the fixed constants, the setting the
EAMC-side fit chose (`--fit-jsonl`, a `moeinf bench cache --out` file of the same trace, seed 0), and
`--restarts` random points of the grid. One JSON line on stdout.

    python bound.py $SHARED/data/traces/dsv2lite-puffin-700.jsonl.gz --top1 --seed 0 --fraction 0.45 \
        --fit-jsonl ../2026-11-29-fitted3/dsv2lite-top1-seed0.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

import numpy as np

from moeinf.bench.cache import access_counts, load_workload, make_policy, split
from moeinf.policy.fitted import FIXED, GRID, EvictionFit, Setting, _policy
from moeinf.policy.simulate import Accesses, simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces")
    parser.add_argument("--top1", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fraction", type=float, required=True)
    parser.add_argument("--fit-jsonl", required=True)
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()
    started = time.perf_counter()
    workload = load_workload(args.traces, quick=False, seed=args.seed, top1=args.top1)
    evaluation, history = split(len(workload.traces), 0.25, args.seed)
    replayed = [workload.traces[i] for i in evaluation]
    counts = access_counts([workload.traces[i] for i in history])
    accesses = Accesses.of(replayed)
    total = workload.num_layers * workload.num_experts
    capacity = max(accesses.busiest, round(args.fraction * total))
    fit = EvictionFit.from_json(json.loads(open(args.fit_jsonl).readline())["fit"])
    n = accesses.keys.size

    def ratio(policy_name: str) -> float:
        policy = make_policy(policy_name, workload, fit, capacity)
        return simulate(accesses, capacity, policy, counts=counts).hits / n

    lru, lfu, belady = ratio("lru"), ratio("lfu"), ratio("oracle")
    fixed = ratio("activation-aware")
    best_base = max(lru, lfu)
    target = max(best_base + min(0.03, (belady - best_base) / 3), fixed - 0.01)
    cache: dict[Setting, int] = {}

    def hits(setting: Setting) -> int:
        if setting not in cache:
            policy = _policy(workload.num_layers, workload.num_experts, setting, fit.top_k)
            cache[setting] = simulate(accesses, capacity, policy, counts=counts).hits
        return cache[setting]

    rng = np.random.default_rng(args.seed)
    starts = [FIXED, fit.setting_for(capacity)]
    starts += [Setting(**{name: float(rng.choice(values)) for name, values in GRID.items()})
               for _ in range(args.restarts)]
    found = []
    for start in starts:
        best = start
        for _ in range(args.passes):
            changed = False
            for name, values in GRID.items():
                for value in values:
                    candidate = Setting(**{**asdict(best), name: value})
                    if hits(candidate) > hits(best):
                        best, changed = candidate, True
            if not changed:
                break
        found.append((hits(best), best))
    top_hits, top = max(found, key=lambda pair: pair[0])
    print(json.dumps({
        "trace": args.traces.rsplit("/", 1)[-1], "top1_proxy": args.top1, "seed": args.seed,
        "cache_fraction": args.fraction, "capacity": capacity, "accesses": int(n),
        "lru": round(lru, 5), "lfu": round(lfu, 5), "belady": round(belady, 5), "fixed": round(fixed, 5),
        "target": round(target, 5), "eval_fit_bound": round(top_hits / n, 5), "eval_fit_setting": asdict(top),
        "bound_per_start": [round(h / n, 5) for h, _ in found], "candidates": len(cache),
        "seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
