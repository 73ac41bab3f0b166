"""Replay an Azure LLM inference trace (arrival times, prompt and output lengths) and measure latency.

Each trace row becomes a request with real prompt text (moeinf/data/prompts) cut or extended to the
row's context length and exactly the row's output length. Policies ("prefetch+eviction" pairs) are
replayed one after another in-process with the server's batching, or once against a running server
(--url). Writes requests.csv, latency_cdf.png, latency_vs_rate.png, summary.json and summary.md.

  moeinf replay --model path/to/model --duration 120 --length-scale 0.25 --max-new-tokens-cap 64 \\
      --policies activation-aware+activation-aware,none+lru --out replay-out
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import shlex
import sys
from typing import Any

from moeinf.config import EVICTION_POLICIES, PREFETCH_POLICIES
from moeinf.replay.workload import DEFAULT_PROMPTS, DEFAULT_TRACE
from moeinf.serve.loader import add_offload_arguments

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace", default=str(DEFAULT_TRACE), help="Azure trace CSV (default: the conv trace)"
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="MODEL_DIR",
        help="model directory (its tokenizer builds the prompts; served in-process)",
    )
    parser.add_argument(
        "--prompts",
        nargs="+",
        default=[str(DEFAULT_PROMPTS)],
        help="prompt .jsonl files or directories (default: moeinf/data/prompts)",
    )
    parser.add_argument("--start-s", type=float, default=0.0, help="skip this many seconds of the trace")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of the trace to replay")
    parser.add_argument("--rps-scale", type=float, default=1.0, help="multiply the request rate")
    parser.add_argument("--length-scale", type=float, default=1.0, help="multiply prompt and output lengths")
    parser.add_argument("--max-new-tokens-cap", type=int, default=None, help="cap output lengths")
    parser.add_argument(
        "--policies",
        default="activation-aware+activation-aware,none+lru",
        help="comma-separated prefetch+eviction pairs, replayed one after another",
    )
    parser.add_argument("--slo-s", type=float, default=1.0, help="per-token latency SLO in seconds")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--max-wait-s", type=float, default=1.0)
    parser.add_argument("--url", default=None, help="replay against this running server instead (one policy)")
    parser.add_argument("--api-key", default=None, help="bearer key of the --url server")
    parser.add_argument("--model-name", default=None, help="model id at --url (default: MODEL_DIR's name)")
    parser.add_argument("--seed", type=int, default=0, help="order in which prompt texts are used")
    parser.add_argument("--out", default="replay-out", help="output directory")
    parser.add_argument("--json", action="store_true", help="print the per-policy summary as JSON")
    add_offload_arguments(parser)


def parse_policies(text: str) -> list[tuple[str, str]]:
    """'a+b,c+d' -> [(prefetch, eviction), ...], validated against the config's policy names."""
    pairs = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        prefetch, sep, eviction = item.partition("+")
        if not sep or prefetch not in PREFETCH_POLICIES or eviction not in EVICTION_POLICIES:
            raise SystemExit(
                f"--policies: {item!r} is not prefetch+eviction with prefetch in {PREFETCH_POLICIES} "
                f"and eviction in {EVICTION_POLICIES}"
            )
        pairs.append((prefetch, eviction))
    if not pairs:
        raise SystemExit("--policies: give at least one prefetch+eviction pair")
    return pairs


def _flat_stats(stats: dict[str, Any]) -> dict[str, float]:
    keys = ("hits", "misses", "hit_rate", "stall_s", "prefetch_precision", "prefetch_recall", "bytes_read")
    return {k: stats[k] for k in keys if isinstance(stats.get(k), (int, float))}


def _advance(bar: Any, _result: object) -> None:
    bar.update(1)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tqdm import tqdm
    from transformers import AutoConfig

    from moeinf.replay.report import markdown_table, summarize, write_report
    from moeinf.replay.runner import replay_local, replay_remote
    from moeinf.replay.workload import PromptPool, build_workload, load_prompts, load_trace, scale_rows
    from moeinf.serve.backend import context_length_of
    from moeinf.serve.loader import load_backend, load_tokenizer, offload_config

    rows = load_trace(args.trace, start_s=args.start_s, duration_s=args.duration)
    rows = scale_rows(
        rows,
        rps_scale=args.rps_scale,
        length_scale=args.length_scale,
        max_new_tokens_cap=args.max_new_tokens_cap,
    )
    pool = PromptPool(load_tokenizer(args.model), load_prompts(args.prompts), seed=args.seed)
    items = build_workload(
        rows, pool, context_length=context_length_of(AutoConfig.from_pretrained(args.model))
    )
    if args.url:
        runs: list[tuple[str, Any]] = [("server", None)]
    elif args.no_offload:
        runs = [("transformers", None)]
    else:
        runs = [
            (f"{p}+{e}", offload_config(args, prefetch=p, eviction=e))
            for p, e in parse_policies(args.policies)
        ]

    by_policy, summary = {}, {}
    bar = tqdm(total=len(items) * len(runs), unit="req", desc="replay", file=sys.stderr)
    for label, config in runs:
        bar.set_postfix_str(label)
        progress = functools.partial(_advance, bar)
        if args.url:
            results = replay_remote(
                args.url,
                items,
                model=args.model_name or Path(args.model).name,
                api_key=args.api_key,
                policy=label,
                progress=progress,
            )
            stats: dict[str, Any] = {}
        else:
            backend = load_backend(args.model, config)
            try:
                results = replay_local(
                    backend,
                    items,
                    policy=label,
                    max_batch=args.max_batch,
                    max_wait_s=args.max_wait_s,
                    progress=progress,
                )
                stats = backend.stats()
            finally:
                backend.close()
        by_policy[label] = results
        summary[label] = summarize(results, slo_s=args.slo_s) | {"runtime": _flat_stats(stats)}
    bar.close()
    meta = {
        "command": "moeinf replay " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
        "trace": args.trace,
        "duration_s": args.duration,
        "start_s": args.start_s,
        "rps_scale": args.rps_scale,
        "length_scale": args.length_scale,
        "max_new_tokens_cap": args.max_new_tokens_cap,
        "requests": len(items),
        "max_batch": args.max_batch,
        "max_wait_s": args.max_wait_s,
    }
    out = write_report(args.out, by_policy, summary, meta, slo_s=args.slo_s)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(markdown_table(summary))
        print(f"\nwritten to {out}/: requests.csv, latency_cdf.png, latency_vs_rate.png, summary.json/.md")
    return 0
