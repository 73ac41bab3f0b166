"""Where a decode token's time goes, per configuration: a diagnostic, not a benchmark.

Runs `moeinf bench e2e`'s workload (same held-out prompts, inflated model, EAMC) through several offloaded
configurations in ONE process, one after the other, and splits each DECODE token (prefill passes excluded)
into:

- moe_s: time inside the MoE layers' expert path (`Offloader.run_layer`), split into stall_s (waiting for
  reads: `stats.stall_s`), demand_s (counting accesses and claiming misses), plan_s (look-ahead, planning,
  pacing and submitting prefetches), guess_s (the first-layer guess off the logits) and the rest
  (expert compute and bookkeeping, `compute_s`);
- rest_s: everything outside the MoE expert path (attention, router, norms, LM head, `generate`);
- per decode token: reads, bytes read, engine checksum CPU (`verify_cpu_s`), stall of the first MoE layer;
- io_busy_s: bytes read / the raw O_DIRECT bandwidth given (`--raw-gbps`), the time the drive needs.

It wraps methods of ONE MoE instance per configuration (instance attributes, nothing global).
One JSON line per configuration.

    python bench/results/2026-11-25b-e2e/timeline.py --cache 25% --variants default,none,resident \
        --prompts 4 --new-tokens 32 --threads 1
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
EAMC = MODEL.with_name(MODEL.name + ".eamc")
VARIANTS = {
    "resident": ("100%", {"prefetch": "none"}),
    "none": (None, {"prefetch": "none", "eviction": "lru"}),
    "default": (None, {"eamc": str(EAMC)}),
    "noverify": (None, {"eamc": str(EAMC), "verify_checksums": False}),
    "io2": (None, {"eamc": str(EAMC), "io_threads": 2}),
    "io1": (None, {"eamc": str(EAMC), "io_threads": 1}),
    "depth1": (None, {"eamc": str(EAMC), "lookahead_depth": 1}),
    "depth2": (None, {"eamc": str(EAMC), "lookahead_depth": 2}),
    "noguess": (None, {"eamc": str(EAMC), "lookahead_next_token": False}),
    "nohold": (None, {"eamc": str(EAMC), "prefetch_hold_plan": False}),
    "minp0.2": (None, {"eamc": str(EAMC), "prefetch_min_probability": 0.2}),
    "minp0.1": (None, {"eamc": str(EAMC), "prefetch_min_probability": 0.1}),
    "minp0.5": (None, {"eamc": str(EAMC), "prefetch_min_probability": 0.5}),
    "plantail": (None, {"eamc": str(EAMC)}),
    "even": (None, {"eamc": str(EAMC)}),
    "odd": (None, {"eamc": str(EAMC)}),
    "lookahead": (None, {"eamc": str(EAMC), "prefetch": "lookahead"}),
}


def measure(workload: e2e.Workload, cache: str, knobs: dict, raw_bps: float, *,
            plan_tail: bool = False) -> dict:
    store = MODEL.with_name(MODEL.name + ".moeinf")
    moe = MoE(MODEL, OffloadConfig(device_cache=cache, offload_dir=str(store), **knobs))
    runtime = moe._runtime
    offloader, cache_ = runtime.offloader, runtime.cache
    engine = getattr(cache_.tier, "engine", None)
    stats = runtime.stats
    import os
    if os.environ.get("PLAN_EVERY"):
        every = int(os.environ["PLAN_EVERY"])
        offloader.prefetch_policy.should_plan = lambda layer: layer % every == 0
    if plan_tail:
        # with tail-hold.patch applied: the last MoE layers plan again, as without it (instance attribute
        # only; without the patch this variant equals `default`)
        offloader._nothing_new = lambda layer: False
    sums: collections.Counter[str] = collections.Counter()
    per_layer_stall: collections.Counter[int] = collections.Counter()
    state = {"measuring": False, "decode": False, "pass_start": None}

    def engine_snapshot() -> tuple[float, int]:
        if engine is None:
            return 0.0, 0
        s = engine.stats()
        return s["verify_cpu_s"], s["bytes_read"]

    def close_pass() -> None:
        start = state["pass_start"]
        if start is not None and state["measuring"] and state["decode"]:
            verify, engine_bytes = engine_snapshot()
            sums["verify_cpu_s"] += verify - start[0]
            sums["engine_bytes"] += engine_bytes - start[1]
            sums["bytes"] += stats.bytes_read - start[2]
            sums["reads"] += stats.reads - start[3]
            sums["pass_wall_s"] += time.perf_counter() - start[4]
            sums["pass_process_cpu_s"] += time.process_time() - start[5]
            sums["pass_main_cpu_s"] += time.thread_time() - start[6]
            sums["demand_reads"] += stats.demand_reads - start[7]
            sums["late_prefetches"] += stats.late_prefetches - start[8]
            sums["plans_held"] += stats.plans_held - start[9]
            sums["prefetches"] += stats.prefetches - start[10]
        state["pass_start"] = None

    def timed(name: str, fn):
        def wrapper(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                if state["measuring"] and state["decode"]:
                    sums[name] += time.perf_counter() - t0
                    sums["cpu_" + name] += time.thread_time() - c0
        return wrapper

    run_layer = offloader.run_layer

    def spy_run_layer(layer, hidden_states, *rest):
        if layer == 0:
            close_pass()
            state["decode"] = hidden_states.shape[0] == 1
            verify, engine_bytes = engine_snapshot()
            state["pass_start"] = (verify, engine_bytes, stats.bytes_read, stats.reads, time.perf_counter(),
                                   time.process_time(), time.thread_time(), stats.demand_reads,
                                   stats.late_prefetches, stats.plans_held, stats.prefetches)
            if state["measuring"] and state["decode"]:
                sums["passes"] += 1
        t0, c0, stall = time.perf_counter(), time.thread_time(), stats.stall_s
        if layer == 0 and state.get("guessed_at") is not None:
            if state["measuring"] and state["decode"]:
                sums["guess_to_layer0_s"] += t0 - state["guessed_at"]
            state["guessed_at"] = None
        try:
            return run_layer(layer, hidden_states, *rest)
        finally:
            if state["measuring"] and state["decode"]:
                sums["moe_s"] += time.perf_counter() - t0
                sums["cpu_moe_s"] += time.thread_time() - c0
                sums["stall_s"] += stats.stall_s - stall
                per_layer_stall[layer] += stats.stall_s - stall

    offloader.run_layer = spy_run_layer
    cache_.demand = timed("demand_s", cache_.demand)
    for name in ("_ahead", "_plan", "_paced"):
        setattr(offloader, name, timed(f"plan{name}_s", getattr(offloader, name)))
    cache_.prefetch = timed("plan_submit_s", cache_.prefetch)
    guess = timed("guess_s", offloader.guess_first_layer)

    def spy_guess(*args, **kwargs):
        state["guessed_at"] = time.perf_counter()
        return guess(*args, **kwargs)

    offloader.guess_first_layer = spy_guess

    workload.decode(moe.generate, [*workload.warm, *workload.inputs] if cache == "100%" else workload.warm)
    close_pass()
    moe.reset_stats()
    if engine is not None:
        engine.reset_stats()
    state["measuring"] = True
    cpu0, main0 = time.process_time(), time.thread_time()
    wall0 = time.perf_counter()
    latencies, tokens = workload.decode(moe.generate, workload.inputs)
    close_pass()
    cpu, main_cpu = time.process_time() - cpu0, time.thread_time() - main0
    wall = time.perf_counter() - wall0
    moe.close()
    n = sums.pop("passes")
    steps = len(latencies)
    per = {k: v / n for k, v in sums.items()}
    # decode latencies start at the 2nd token: the medians are over the steps, the means over the passes
    per["plan_s"] = sum(v for k, v in per.items() if k.startswith("plan_"))
    per["cpu_plan_s"] = sum(v for k, v in per.items() if k.startswith("cpu_plan_"))
    main_cpu_per_token = per["pass_main_cpu_s"]
    compute = per["moe_s"] - per.get("stall_s", 0) - per.get("demand_s", 0) - per["plan_s"]
    mean_token = statistics.fmean(latencies)
    return {
        "median_ms": round(statistics.median(latencies) * 1e3, 2),
        "mean_ms": round(mean_token * 1e3, 2),
        "decode_passes": n, "steps": steps,
        "ms_per_token": {
            "moe": round(per["moe_s"] * 1e3, 2),
            "stall": round(per.get("stall_s", 0) * 1e3, 2),
            "demand": round(per.get("demand_s", 0) * 1e3, 2),
            "plan": round(per.get("plan_s", 0) * 1e3, 2),
            **{k[:-2]: round(v * 1e3, 2) for k, v in per.items() if k.startswith("plan_")},
            "guess": round(per.get("guess_s", 0) * 1e3, 2),
            "expert_compute_rest": round(compute * 1e3, 2),
            "outside_moe": round((mean_token - per["moe_s"] - per.get("guess_s", 0)) * 1e3, 2),
            "verify_cpu": round(per.get("verify_cpu_s", 0) * 1e3, 2),
            "guess_to_layer0": round(per.get("guess_to_layer0_s", 0) * 1e3, 2),
            "io_busy_at_raw_bw": round(per.get("bytes", 0) / raw_bps * 1e3, 2),
        },
        "main_thread_cpu_ms_per_token": {
            "total": round(main_cpu_per_token * 1e3, 2),
            "moe": round(per.get("cpu_moe_s", 0) * 1e3, 2),
            "plan": round(per["cpu_plan_s"] * 1e3, 2),
            "demand": round(per.get("cpu_demand_s", 0) * 1e3, 2),
            "guess": round(per.get("cpu_guess_s", 0) * 1e3, 2),
            "moe_minus_plan_demand": round((per.get("cpu_moe_s", 0) - per["cpu_plan_s"]
                                            - per.get("cpu_demand_s", 0)) * 1e3, 2),
            "outside_moe": round((main_cpu_per_token - per.get("cpu_moe_s", 0)
                                  - per.get("cpu_guess_s", 0)) * 1e3, 2),
        },
        "stall_ms_by_layer": {str(k): round(v / n * 1e3, 2) for k, v in sorted(per_layer_stall.items())},
        "reads_per_token": round(per.get("reads", 0), 2),
        "demand_reads_per_token": round(per.get("demand_reads", 0), 3),
        "late_prefetches_per_token": round(per.get("late_prefetches", 0), 3),
        "prefetches_per_token": round(per.get("prefetches", 0), 3),
        "plans_held_per_token": round(per.get("plans_held", 0), 3),
        "mb_per_token": round(per.get("bytes", 0) / 1e6, 1),
        "process_cpu_per_wall": round(per["pass_process_cpu_s"] / per["pass_wall_s"], 2),
        "main_thread_cpu_per_wall": round(per["pass_main_cpu_s"] / per["pass_wall_s"], 2),
        "other_threads_cpu_ms_per_token": round((per["pass_process_cpu_s"] - per["pass_main_cpu_s"]) * 1e3,
                                                2),
        "pass_wall_ms": round(per["pass_wall_s"] * 1e3, 2),
        "whole_run_cpu_per_wall": round(cpu / wall, 2),
        "whole_run_main_cpu_per_wall": round(main_cpu / wall, 2),
        "tokens": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default="25%")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default="resident,none,default")
    ap.add_argument("--raw-gbps", type=float, default=3.3, help="the drive's raw O_DIRECT GB/s (bench e2e)")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    workload, _ = e2e.build_workload(MODEL, argparse.Namespace(
        warmup=args.warmup, prompts=args.prompts, eamc_prompts=1, seed=0, max_prompt_tokens=256,
        new_tokens=args.new_tokens))
    reference = None
    for name in args.variants.split(","):
        cache, knobs = VARIANTS[name]
        load0 = Path("/proc/loadavg").read_text().split()[:3]
        row = measure(workload, cache or args.cache, knobs, args.raw_gbps * 1e9, plan_tail=name == "plantail")
        if reference is None:
            reference = row["tokens"]
        row = {"variant": name, "cache": cache or args.cache, "threads": args.threads, "knobs": knobs,
               **row, "tokens_equal_first": row.pop("tokens") == reference,
               "loadavg": [load0, Path("/proc/loadavg").read_text().split()[:3]]}
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
