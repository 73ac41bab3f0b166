"""What a decode step costs as rows are added: does a batch pay?

For each --batch-sizes B, a freshly loaded offloaded model (--device-cache, default 25% of its experts)
prefills B held-out prompts as one running batch (`moeinf.serve.running.RunningBatch`, the server's),
decodes --warmup steps unmeasured, then times --steps decode steps. Per B: the median step time, its
ratio to B=1 (`cost_vs_one`; B rows decoded one at a time would cost B x), the median over repeats of
each repeat's ratio to its own B=1 run (`cost_vs_one_paired`, robust to a load that drifts over the
sweep), the step time per row, and
the distinct experts per MoE layer the batch touched over all measured steps, expert reads per step
and the hit ratio. An expert several rows route to is read once and computed once per layer for all
their tokens (`kernels.moe.Dispatch`), so the cost grows with the distinct experts, not the rows.

  moeinf bench batch --zoo full --device-cache 25% --batch-sizes 1,2,4,8 --out DIR
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from moeinf.bench.common import emit, machine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the cached zoo --zoo)")
    parser.add_argument("--zoo", default="full", help="zoo variant used without --model")
    parser.add_argument("--device-cache", default="25%", help="expert cache budget (share of expert bytes)")
    parser.add_argument("--batch-sizes", default="1,2,4,8", help="comma-separated rows per decode step")
    parser.add_argument("--steps", type=int, default=24, help="measured decode steps per batch size")
    parser.add_argument("--warmup", type=int, default=8, help="decode steps first, unmeasured")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="tokens of each prompt")
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="the whole sweep runs this many times, interleaved; medians over all",
    )
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a busy 2-core machine, 2 are often slower)")
    parser.add_argument("--out", default=None, help="write batch.jsonl and batch.png in this directory")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _prompts(tokenizer: Any, n: int, length: int) -> list[list[int]]:
    from moeinf.replay.workload import PromptPool, load_prompts

    pool = PromptPool(tokenizer, load_prompts(), seed=1)
    return [pool.take(length)[0] for _ in range(n)]


def measure(
    model: Path, config: Any, rows: int, prompts: list[list[int]], warmup: int, steps: int
) -> dict[str, Any]:
    """Per-step times and expert counters of `rows` rows decoding together on a fresh model."""
    from moeinf.serve.backend import SamplingParams
    from moeinf.serve.loader import load_backend

    backend = load_backend(model, config)
    try:
        batch = backend.open_batch()
        params = SamplingParams(max_tokens=warmup + steps + 2, temperature=0.0, ignore_eos=True)
        batch.join(list(range(rows)), prompts[:rows], [params] * rows)
        for _ in range(warmup):
            batch.step()
        offloader = backend.forward._live().offloader
        before, eams_before = backend.stats(), offloader.batch.eams.copy()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            batch.step()
            times.append(time.perf_counter() - start)
        after = backend.stats()
        # distinct experts per layer the batch routed to over the measured steps (growth of the row EAMs)
        touched = (offloader.batch.eams - eams_before).sum(axis=0)  # [L, E] tokens over the steps
        batch.close()
    finally:
        backend.close()
    accesses = after["accesses"] - before["accesses"]
    return {
        "step_s": statistics.median(times),
        "times": times,
        "experts_per_layer_all_steps": float(np.count_nonzero(touched, axis=1).mean()),
        "reads_per_step": (after["reads"] - before["reads"]) / steps,
        "hit_rate": (after["hits"] - before["hits"]) / accesses if accesses else None,
    }


def summarise(runs: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per batch size from its repeats (`measure` results, repeat i of every size in one sweep)."""
    one = statistics.median(t for r in runs[1] for t in r["times"])
    results = []
    for b in runs:
        step = statistics.median(t for r in runs[b] for t in r["times"])
        results.append(
            {
                "rows": b,
                "step_ms": 1000 * step,
                "cost_vs_one": step / one,
                # per repeat against the one-row run just before it, then the median: the machine's load
                # drifts over a sweep, and a pooled median compares sizes measured minutes apart
                "cost_vs_one_paired": statistics.median(
                    r["step_s"] / base["step_s"] for r, base in zip(runs[b], runs[1], strict=True)
                ),
                "ms_per_row": 1000 * step / b,
                "experts_per_layer_all_steps": statistics.mean(
                    r["experts_per_layer_all_steps"] for r in runs[b]
                ),
                "reads_per_step": statistics.mean(r["reads_per_step"] for r in runs[b]),
                "hit_rate": statistics.mean(r["hit_rate"] for r in runs[b] if r["hit_rate"] is not None),
            }
        )
    return results


def run(args: argparse.Namespace) -> int:
    from moeinf import zoo
    from moeinf.config import OffloadConfig
    from moeinf.serve.loader import load_tokenizer

    if args.model:
        model = Path(args.model)
        if not (model / "config.json").is_file():
            raise SystemExit(f"moeinf bench batch: error: {model} holds no checkpoint (no config.json)")
        config = OffloadConfig(device_cache=args.device_cache)
    else:  # the zoo model as `moeinf serve` runs it: its shipped EAMC, its store in the cache
        model = zoo.get_model(args.zoo)
        config = OffloadConfig(device_cache=args.device_cache, eamc=zoo.shipped_eamc(args.zoo),
                               offload_dir=zoo.store_dir(model))
    import torch

    sizes = [int(s) for s in args.batch_sizes.split(",")]
    if 1 not in sizes or min(sizes) < 1:
        raise SystemExit("moeinf bench batch: error: --batch-sizes must include 1 (the baseline) and be >= 1")
    if args.threads < 1:
        raise SystemExit("moeinf bench batch: error: --threads must be >= 1")
    torch.set_num_threads(args.threads)
    prompts = _prompts(load_tokenizer(model), max(sizes), args.prompt_tokens)
    runs: dict[int, list[dict[str, Any]]] = {b: [] for b in sizes}
    for _ in range(args.repeats):
        for b in sizes:
            runs[b].append(measure(model, config, b, prompts, args.warmup, args.steps))
    results = summarise(runs)
    header = {
        "bench": "batch",
        "model": str(model),
        "device_cache": args.device_cache,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "prompt_tokens": args.prompt_tokens,
        "threads": args.threads,
        "machine": machine(),
    }
    emit("batch", results, header, out=args.out, as_json=args.json, plot=_plot, table=_table)
    return 0


def _table(results: list[dict[str, Any]], header: dict[str, Any]) -> str:
    lines = [
        f"decode step cost by batch size ({header['model']}, device_cache {header['device_cache']})",
        "| rows | step ms | cost vs 1 row | paired | ms per row | experts/layer (all steps) | reads/step "
        "| hit rate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['rows']} | {r['step_ms']:.1f} | {r['cost_vs_one']:.2f}x | "
            f"{r['cost_vs_one_paired']:.2f}x | {r['ms_per_row']:.1f} | "
            f"{r['experts_per_layer_all_steps']:.1f} | {r['reads_per_step']:.1f} | {r['hit_rate']:.2f} |"
        )
    return "\n".join(lines)


def _plot(path: Path, results: list[dict[str, Any]], header: dict[str, Any]) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    rows = [r["rows"] for r in results]
    ax.plot(rows, [r["cost_vs_one"] for r in results], marker="o", label="measured step cost")
    ax.plot(rows, rows, linestyle="--", color="grey", label="rows one at a time")
    ax.set_xlabel("rows decoded together")
    ax.set_ylabel("decode step cost / one row's")
    ax.set_title(f"Batch cost at device_cache {header['device_cache']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
