"""Expert parallelism: decode ms/token at 1 and N ranks on this machine, bytes exchanged per token, SSD reads
in steady state, and (with --traces) the placement table: max/mean (token, expert) pairs per rank per
layer for round-robin and traced (balanced) placement.

  moeinf bench ep                                   # the shipped zoo model, 1 and 2 ranks, 60% per rank
  moeinf bench ep MODEL --ranks 1,2 --device-cache 60% --traces ../shared/data/traces/X.jsonl.gz --json

Each rank is a process of its own (gloo over loopback, as torchrun starts them) with cores / ranks torch
threads: on a 2-core machine two ranks share the two cores that one rank had to itself, so the figure
shows what the exchange costs, not what more machines would gain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from .common import emit, machine

WORKER = """
import json, statistics, sys, time, torch
from moeinf import MoE, OffloadConfig
from moeinf.parallel import ep
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
with MoE(spec["model"], OffloadConfig(device_cache=spec["cache"], offload_dir=spec["store"])) as moe:
    for ids in spec["prompts"]:  # warm-up: every rank loads its experts
        moe.generate(torch.tensor([ids]), max_new_tokens=spec["new_tokens"], do_sample=False, pad_token_id=0)
    moe.reset_stats()
    ms = []
    for ids in spec["prompts"]:
        start = time.perf_counter()
        out = moe.generate(torch.tensor([ids]), max_new_tokens=spec["new_tokens"], do_sample=False,
                           pad_token_id=0)
        ms.append(1000 * (time.perf_counter() - start) / (out.shape[1] - len(ids)))
    stats = moe.stats()
ep.release_followers()
json.dump({"ms": ms, "stats": stats}, open(spec["out"], "w"))
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="HF checkpoint directory (default: the shipped zoo model)")
    parser.add_argument("--ranks", default="1,2", help="rank counts to measure, comma-separated")
    parser.add_argument("--device-cache", default="60%",
                        help="expert budget of EACH rank (%% of all experts)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts from MT-Bench")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--traces", default=None,
                        help="raw routing trace (.jsonl or .jsonl.gz) for the placement table")
    parser.add_argument("--out", default=None, help="directory for ep.jsonl and ep.png")
    parser.add_argument("--json", action="store_true")


def _prompts(model_dir: Path, count: int) -> list[list[int]]:
    from ..hf.tokenizer import load_tokenizer
    from .e2e import load_prompts

    tokenizer, _ = load_tokenizer(model_dir)
    return [tokenizer(text, add_special_tokens=False).input_ids[:48] for text in load_prompts(count)]


def measure(model_dir: Path, ranks: int, cache: str, prompts: list[list[int]],
            new_tokens: int) -> dict[str, Any]:
    """Run the worker on `ranks` processes; rank 0's figures."""
    from ..parallel.ep import spawn_local
    from ..zoo import store_dir  # in the cache, never beside a (possibly packaged) checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        threads = max(1, (os.cpu_count() or 1) // ranks)
        spec = {"model": str(model_dir), "cache": cache, "prompts": prompts, "new_tokens": new_tokens,
                "out": str(out), "threads": threads, "store": str(store_dir(model_dir))}
        procs = spawn_local(ranks, ["-c", WORKER, json.dumps(spec)], threads=threads, stderr=subprocess.PIPE)
        errors = [(p.wait(), p.stderr.read() if p.stderr else "") for p in procs]
        for rank, (code, err) in enumerate(errors):
            if code != 0:
                raise RuntimeError(f"rank {rank} of {ranks} failed: {err.strip().splitlines()[-1:]}")
        result = json.loads(out.read_text())
    stats = result["stats"]
    tokens = max(int(stats.get("tokens", 0)), 1)
    ep_stats = stats.get("ep", {})
    reads = [stats.get("reads", 0)] + [r.get("reads", 0) for r in ep_stats.get("rank_stats", [])]
    return {"ranks": ranks, "ms_per_token": statistics.median(result["ms"]),
            "tokens_per_s": 1000 / statistics.median(result["ms"]),
            "exchanged_bytes_per_token": (ep_stats.get("bytes_sent", 0) + ep_stats.get("bytes_received", 0))
            / tokens, "steady_state_reads": reads}


def placement_table(path: str, ranks_list: list[int]) -> list[dict[str, Any]]:
    """Round-robin vs balanced placement on a raw trace: fit on even requests, evaluate on odd ones."""
    from ..parallel.placement import balanced, round_robin, step_imbalance, token_pairs
    from ..trace.rawtrace import read_raw

    traces = list(read_raw(path))
    num_layers, num_experts = traces[0].num_layers, traces[0].num_experts

    def records(subset: list[Any]):
        for trace in subset:
            for step in trace.steps:
                for layer, (ids, _) in step.items():
                    yield layer, ids

    fit, held_out = traces[::2], traces[1::2]
    load, coact = token_pairs(records(fit), num_layers, num_experts)
    rows = []
    for ranks in ranks_list:
        owners = {"round-robin": round_robin(num_layers, num_experts, ranks),
                  "balanced (load)": balanced(load, None, ranks),
                  "balanced (load + co-activation)": balanced(load, coact, ranks)}
        for name, owner in owners.items():
            per_layer = step_imbalance(owner, records(held_out), ranks)
            rows.append({"placement": name, "ranks": ranks, "max_over_mean_mean": float(per_layer.mean()),
                         "max_over_mean_worst_layer": float(per_layer.max()),
                         "per_layer": [round(float(x), 3) for x in per_layer]})
    return rows


def _table(results: list[dict[str, Any]], header: dict[str, Any]) -> str:
    lines = ["ranks  ms/token  tokens/s  exchanged B/token  steady-state SSD reads per rank"]
    for r in results:
        if "ms_per_token" in r:
            lines.append(f"{r['ranks']:>5}  {r['ms_per_token']:8.1f}  {r['tokens_per_s']:8.1f}  "
                         f"{r['exchanged_bytes_per_token']:17.0f}  {r['steady_state_reads']}")
    placed = [r for r in results if "placement" in r]
    if placed:
        lines += ["", "placement (held-out requests)        ranks  max/mean per layer (mean, worst)"]
        lines += [f"{r['placement']:<36} {r['ranks']:>5}  {r['max_over_mean_mean']:.3f}, "
                  f"{r['max_over_mean_worst_layer']:.3f}" for r in placed]
    return "\n".join(lines)


def _plot(path: Path, results: list[dict[str, Any]], header: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in results if "ms_per_token" in r]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([str(r["ranks"]) for r in timed], [r["ms_per_token"] for r in timed])
    ax.set_xlabel("ranks")
    ax.set_ylabel("ms/token (median)")
    ax.set_title("expert parallelism on this machine")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from ..zoo import get_model
    from .common import refuse_counts

    refuse_counts("ep", args, positive=("prompts", "new_tokens"))

    model_dir = Path(args.model) if args.model else get_model("full", progress=False)
    ranks_list = [int(x) for x in args.ranks.split(",") if x.strip()]
    if not ranks_list or min(ranks_list) < 1:
        print("moeinf bench ep: error: --ranks takes positive counts such as 1,2", file=sys.stderr)
        return 2
    prompts = _prompts(model_dir, args.prompts)
    results: list[dict[str, Any]] = []
    for ranks in ranks_list:
        started = time.perf_counter()
        results.append(measure(model_dir, ranks, args.device_cache, prompts, args.new_tokens))
        results[-1]["wall_s"] = round(time.perf_counter() - started, 1)
    if args.traces:
        results += placement_table(args.traces, sorted({r for r in ranks_list if r > 1} | {2, 4}))
    header = {"bench": "ep", "model": str(model_dir), "device_cache_per_rank": args.device_cache,
              "prompts": len(prompts), "new_tokens": args.new_tokens, "machine": machine(),
              "load_avg": os.getloadavg()[0], "numpy": np.__version__}
    emit("ep", results, header, out=args.out, as_json=args.json, plot=_plot, table=_table)
    return 0
