"""Prefetch benchmark: recall of the prefetch policies against model width and transfer bandwidth.

Replays routing traces through the offline simulator (`moeinf.policy.simulate`) with activation-aware
eviction, a cache of `--cache-fraction` of the experts and a transfer channel of B GB/s, for prefetch
activation-aware (Algorithm 1, matched EAM from an EAMC built on training sequences), topk (the
sequence's own most used experts), traced-topk (the experts most popular over the training
sequences) and none, each with refinement after every layer and without (one plan per pass).

Two sweeps: the number of experts (8..256, synthetic models, top-k grows with E) at `--gbps`, and the
bandwidth (0.5..32 GB/s) for one model. Bandwidth becomes experts per layer with `--expert-mib` (one
expert's size; default 9 MiB, a Qwen3-30B-A3B expert in bf16) and `--layer-ms` (compute time of one MoE
layer per step). Recall = accesses served by a prefetched expert in time / accesses; precision = used
prefetches / completed prefetches. With `--traces FILE` (a raw routing trace), the first 80% of the
requests train the EAMC and only the bandwidth sweep runs (the model fixes the number of experts).

With `--model DIR` the predictors are measured live on that model instead: slot recall and precision
per predictor (none, topk, traced-topk, activation-aware, the look-ahead router and learned maps,
hybrid) and look-ahead depth, on held-out prompts (`moeinf.bench.prefetch_live`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moeinf.bench.cache import busiest_layer, load_workload, synthetic_model
from moeinf.bench.common import emit, machine
from moeinf.policy import make_eviction, make_prefetch, popularity
from moeinf.policy.simulate import Matcher, bandwidth_in_experts, eams_of, simulate

log = logging.getLogger(__name__)

POLICIES = ("activation-aware", "topk", "traced-topk", "none")
EXPERTS = (8, 16, 32, 64, 128, 256)
QUICK_EXPERTS = (8, 32, 128)
GBPS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
QUICK_GBPS = (0.5, 4.0, 32.0)


def top_k_for(num_experts: int) -> int:
    """Experts per token of a synthetic model with `num_experts` (Mixtral 8:2 ... Qwen3 128:8)."""
    return min(8, max(2, num_experts // 16))


def eamc_matcher(train: Sequence[np.ndarray], capacity: int, seed: int) -> Matcher:
    """Build an EAMC (K-Means medoids, Eq. 1) over the training sequences' EAMs; match against it."""
    from moeinf.trace.eam import flat_unit_rows
    from moeinf.trace.eamc import EAMC, distinct_count

    eams = eams_of(train)
    capacity = min(capacity, distinct_count(flat_unit_rows(eams)))
    eamc = EAMC.build(eams, capacity, seed=seed)
    return lambda partial, observed: eamc.match(np.asarray(partial, dtype=np.float32), observed)[1]


def sweep(train: Sequence[np.ndarray], test: Sequence[np.ndarray], *, num_layers: int, num_experts: int,
          top_k: int, cache_fraction: float, gbps: float, expert_bytes: int, layer_seconds: float,
          eamc_capacity: int, seed: int) -> list[dict[str, Any]]:
    """Every prefetch policy, refinement on and off, on one model at one bandwidth."""
    matcher = eamc_matcher(train, eamc_capacity, seed)
    pop = popularity(eams_of(train))
    capacity = max(busiest_layer(test), round(cache_fraction * num_layers * num_experts))
    bandwidth = bandwidth_in_experts(gbps, expert_bytes, layer_seconds)
    rows = []
    for name in POLICIES:
        for refine in (True, False) if name != "none" else (True,):
            prefetch = make_prefetch(name, num_layers, num_experts, top_k=top_k, popularity=pop,
                                     refine=refine)
            eviction = make_eviction("activation-aware", num_layers, num_experts)
            result = simulate(test, capacity, eviction, prefetch, matcher=matcher, bandwidth=bandwidth)
            rows.append({"policy": name, "refine": refine, "num_experts": num_experts, "top_k": top_k,
                         "num_layers": num_layers, "gbps": gbps,
                         "experts_per_layer_time": round(bandwidth, 4),
                         "capacity": capacity, "recall": round(result.prefetch_recall, 4),
                         "prediction_recall": round(result.prediction_recall, 4),
                         "precision": round(result.prefetch_precision, 4),
                         "hit_ratio": round(result.hit_ratio, 4),
                         "stall_per_layer": round(result.stall / result.compute, 4)})
            log.info("%s refine=%s E=%d %.1f GB/s: recall %.3f", name, refine, num_experts, gbps,
                     result.prefetch_recall)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moeinf.bench import prefetch_live

    parser.add_argument("--model", metavar="DIR", help="measure the predictors live on this checkpoint "
                        "(a zoo model or its inflation) instead of simulating")
    prefetch_live.add_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="small models, three points per sweep")
    parser.add_argument("--json", action="store_true", help='print {"results": [...]} instead of a table')
    parser.add_argument("--traces", metavar="FILE", help="raw routing trace (JSONL from `moeinf trace`); "
                        "default: synthetic models")
    parser.add_argument("--out", metavar="DIR", help="write prefetch.jsonl and prefetch.png here")
    parser.add_argument("--gbps", type=float, default=8.0, help="bandwidth of the experts sweep (GB/s)")
    parser.add_argument("--expert-mib", type=float, default=9.0, help="size of one expert (MiB)")
    parser.add_argument("--layer-ms", type=float, default=2.0, help="compute time of one MoE layer (ms)")
    parser.add_argument("--cache-fraction", type=float, default=0.1, help="cache size, fraction of experts")
    parser.add_argument("--eamc-capacity", type=int, default=32, help="EAMC entries built from training")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    if args.model:
        return run_live(args)
    if not 0.0 < args.cache_fraction <= 1.0:
        raise SystemExit("moeinf bench prefetch: error: --device-cache must be a share of the experts in "
                         f"(0%, 100%], got {100 * args.cache_fraction:g}%")
    if min(args.gbps, args.expert_mib, args.layer_ms) <= 0 or args.eamc_capacity < 1:
        raise SystemExit("moeinf bench prefetch: error: --gbps, --expert-mib and --layer-ms must be > 0 and "
                         "--eamc-capacity >= 1")
    started = time.perf_counter()
    expert_bytes = int(args.expert_mib * 2**20)
    common = {"cache_fraction": args.cache_fraction, "expert_bytes": expert_bytes,
              "layer_seconds": args.layer_ms / 1000.0, "eamc_capacity": args.eamc_capacity, "seed": args.seed}
    results: list[dict[str, Any]] = []
    if args.traces:
        workload = load_workload(args.traces, quick=args.quick, seed=args.seed, command="prefetch")
        split = max(1, int(0.8 * len(workload.traces)))
        train, test = workload.traces[:split], workload.traces[split:] or workload.traces[-1:]
        shape = {"num_layers": workload.num_layers, "num_experts": workload.num_experts,
                 "top_k": workload.top_k}
        name = workload.name
    else:
        name = "synthetic"
        sequences = (16, 6) if args.quick else (80, 24)
        for num_experts in QUICK_EXPERTS if args.quick else EXPERTS:
            model = synthetic_model(quick=args.quick, seed=args.seed, num_experts=num_experts,
                                    top_k=top_k_for(num_experts))
            train, _ = model.traces(sequences[0], seed=args.seed + 1)
            test, _ = model.traces(sequences[1], seed=args.seed + 2)
            rows = sweep(train, test, num_layers=model.num_layers, num_experts=num_experts, top_k=model.top_k,
                         gbps=args.gbps, **common)
            results.extend({"sweep": "experts", **row} for row in rows)
        model = synthetic_model(quick=args.quick, seed=args.seed)
        train, _ = model.traces(sequences[0], seed=args.seed + 1)
        test, _ = model.traces(sequences[1], seed=args.seed + 2)
        shape = {"num_layers": model.num_layers, "num_experts": model.num_experts, "top_k": model.top_k}
    for gbps in QUICK_GBPS if args.quick else GBPS:
        rows = sweep(train, test, gbps=gbps, **shape, **common)
        results.extend({"sweep": "bandwidth", **row} for row in rows)
    header = {"bench": "prefetch", "workload": name, "synthetic": name == "synthetic",
              "eviction": "activation-aware", "expert_mib": args.expert_mib, "layer_ms": args.layer_ms,
              "cache_fraction": args.cache_fraction,
              "eamc_capacity": args.eamc_capacity, "seconds": round(time.perf_counter() - started, 2),
              "machine": machine()}
    emit("prefetch", results, header, out=args.out, as_json=args.json, plot=plot, table=table)
    return 0


def run_live(args: argparse.Namespace) -> int:
    from moeinf.bench import prefetch_live

    if min(args.train_prompts, args.test_prompts, args.new_tokens, args.depth, args.threads) < 1:
        print("moeinf bench prefetch: error: --train-prompts, --test-prompts, --new-tokens, --depth and "
              "--threads must be >= 1", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(args.threads)
    try:
        rows, header = prefetch_live.measure(Path(args.model), train_prompts=args.train_prompts,
                                             test_prompts=args.test_prompts, new_tokens=args.new_tokens,
                                             depth=args.depth, threshold=args.threshold,
                                             max_prompt_tokens=64, seed=args.seed)
    except ValueError as exc:
        print(f"moeinf bench prefetch: error: {exc}", file=sys.stderr)
        return 2
    header["machine"] = machine()
    emit("prefetch", rows, header, out=args.out, as_json=args.json, plot=prefetch_live.plot,
         table=prefetch_live.table)
    return 0


def _label(row: dict[str, Any]) -> str:
    return row["policy"] if row["refine"] else f"{row['policy']} (once)"


def table(results: Sequence[dict[str, Any]], header: dict[str, Any]) -> str:
    """Recall per sweep point (rows) and policy (columns); `(once)` = no refinement."""
    labels = list(dict.fromkeys(_label(row) for row in results if row["policy"] != "none"))
    lines = [f"prefetch recall, workload {header['workload']}, "
             f"cache {header['cache_fraction']:.0%} of the experts, (once) = no refinement"]
    for sweep_name, axis in (("experts", "num_experts"), ("bandwidth", "gbps")):
        rows = [row for row in results if row["sweep"] == sweep_name]
        if not rows:
            continue
        lines.append(f"{axis:>12}" + "".join(f"{label:>26}" for label in labels))
        for value in dict.fromkeys(row[axis] for row in rows):
            recall = {_label(row): row["recall"] for row in rows if row[axis] == value}
            lines.append(f"{value:>12}" + "".join(f"{recall[label]:>26.3f}" for label in labels))
    return "\n".join(lines)


def plot(path: Path, results: Sequence[dict[str, Any]], header: dict[str, Any]) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    sweeps = [(name, axis) for name, axis in (("experts", "num_experts"), ("bandwidth", "gbps"))
              if any(row["sweep"] == name for row in results)]
    figure = Figure(figsize=(6 * len(sweeps), 4))
    for axes, (sweep_name, axis) in zip(np.atleast_1d(figure.subplots(1, len(sweeps))), sweeps, strict=True):
        rows = [row for row in results if row["sweep"] == sweep_name and row["policy"] != "none"]
        for label in dict.fromkeys(_label(row) for row in rows):
            points = [row for row in rows if _label(row) == label]
            axes.plot([row[axis] for row in points], [row["recall"] for row in points], marker="o",
                      linestyle="-" if points[0]["refine"] else "--", label=label)
        axes.set_xscale("log", base=2)
        axes.set_xlabel("experts per layer" if axis == "num_experts" else "transfer bandwidth (GB/s)")
        axes.set_ylabel("prefetch recall")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(f"prefetch recall, {header['workload']} workload")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
