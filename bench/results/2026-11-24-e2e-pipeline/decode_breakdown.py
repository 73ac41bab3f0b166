"""Where the decode steps' expert accesses come from, per token: a diagnostic, not a benchmark.

Runs `moeinf bench e2e`'s workload (same held-out prompts, same inflated model and EAMC) through one
offloaded configuration and classifies every expert access of the DECODE passes (prefill excluded, unlike
`moeinf.runtime.stats`, whose counters include the prompt passes):

- hit_cached: resident and not brought by a prefetch of this pass; hit_prefetched: a prefetch landed in
  time; late_prefetched: a prefetch was still in flight (compute waited for the rest of the read);
- demand_read: neither resident nor in flight, read on demand, split by whether the key was in a
  planned prefetch list before pacing (`dropped_by_pacing`), after pacing but never issued
  (`kept_not_issued`), issued then cancelled (`cancelled`), or never predicted (`not_predicted`);
- issued: prefetches started; evicted_unused: prefetches evicted before any access.

It wraps methods of ONE MoE instance (instance attributes, nothing global). One JSON line per run.

    python bench/results/2026-11-24-e2e-pipeline/decode_breakdown.py --cache 25% [--prefetch hybrid]
        [--knobs '{"lookahead_next_token": false}'] [--old]   # --old: demand claimed after the plan
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import torch

from moeinf import MoE, OffloadConfig
from moeinf.bench import e2e

MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default="25%")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prefetch", default="hybrid")
    ap.add_argument("--knobs", default="{}")
    ap.add_argument("--old", action="store_true", help="claim demand reads after the plan (before 7e85d85)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    workload, _ = e2e.build_workload(MODEL, argparse.Namespace(
        warmup=args.warmup, prompts=args.prompts, eamc_prompts=1, seed=0, max_prompt_tokens=256,
        new_tokens=args.new_tokens))
    knobs = {"prefetch": args.prefetch, **json.loads(args.knobs)}
    if args.prefetch == "none":
        knobs["eviction"] = "lru"
    else:
        knobs["eamc"] = str(MODEL.with_name(MODEL.name + ".eamc"))
    store = MODEL.with_name(MODEL.name + ".moeinf")
    moe = MoE(MODEL, OffloadConfig(device_cache=args.cache, offload_dir=str(store), **knobs))
    runtime = moe._runtime
    offloader, cache = runtime.offloader, runtime.cache
    if args.old:
        cache.demand = lambda keys, ctx: None
    counts: collections.Counter[str] = collections.Counter()
    seconds: collections.Counter[str] = collections.Counter()
    planned, kept, cancelled = set(), set(), set()
    on = {"measuring": False, "decode": False}

    def active() -> bool:
        return on["measuring"] and on["decode"]

    run_layer, paced, prefetch = offloader.run_layer, offloader._paced, cache.prefetch
    evict, count = cache._evict, cache._count_access

    def spy_run_layer(layer, hidden_states, *rest):
        on["decode"] = hidden_states.shape[0] == 1
        start, stall = time.perf_counter(), runtime.stats.stall_s
        try:
            return run_layer(layer, hidden_states, *rest)
        finally:
            if active():
                counts["layers"] += 1
                seconds["run_layer"] += time.perf_counter() - start
                seconds["stall"] += runtime.stats.stall_s - stall

    def spy_paced(layer, plan, needed):
        out, budget = paced(layer, plan, needed)
        if active():
            planned.update(key for key, _ in plan)
            kept.update(key for key, _ in out)
        return out, budget

    def spy_prefetch(plan, ctx, max_new=None):
        before = set(cache.in_flight)
        prefetch(plan, ctx, max_new)
        if active():
            counts["issued"] += len(set(cache.in_flight) - before)
            cancelled.update(before - set(cache.in_flight) - set(cache.resident))

    def spy_evict(key):
        if active() and key in cache.prefetched:
            counts["evicted_unused"] += 1
        evict(key)

    def spy_count(key):
        if active():
            counts["accesses"] += 1
            if key in cache.resident:
                counts["hit_prefetched" if key in cache.prefetched else "hit_cached"] += 1
            elif key in cache.in_flight:
                if key in cache.prefetched:
                    counts["late_prefetched"] += 1
                    counts[f"late_prefetched_layer{key[0]}"] += 1
            else:
                counts["demand_read"] += 1
                counts[f"demand_read_layer{key[0]}"] += 1
                cause = ("cancelled" if key in cancelled else "kept_not_issued" if key in kept
                         else "dropped_by_pacing" if key in planned else "not_predicted")
                counts[f"demand_{cause}"] += 1
            for seen in (planned, kept, cancelled):
                seen.discard(key)
        count(key)

    offloader.run_layer, offloader._paced, cache.prefetch = spy_run_layer, spy_paced, spy_prefetch
    cache._evict, cache._count_access = spy_evict, spy_count
    workload.decode(moe.generate, workload.warm)
    moe.reset_stats()
    on["measuring"] = True
    latencies, _ = workload.decode(moe.generate, workload.inputs)
    moe.close()
    tokens = counts["layers"] / offloader.num_layers
    print(json.dumps({
        "cache": args.cache, "knobs": knobs, "old_order": args.old, "decode_tokens": tokens,
        "median_ms_per_token": round(statistics.median(latencies) * 1e3, 1),
        "per_token": {k: round(v / tokens, 3) for k, v in sorted(counts.items()) if k != "layers"},
        "ms_per_token": {k: round(v / tokens * 1e3, 2) for k, v in sorted(seconds.items())},
        "loadavg": Path("/proc/loadavg").read_text().split()[:3]}))


if __name__ == "__main__":
    main()
