"""Replay an Azure LLM inference trace (arrival times, prompt and output lengths) and measure latency.

Each trace row becomes a request with real prompt text (moeinf/data/prompts) cut or extended to the
row's context length and exactly the row's output length. Every combination of --prefetch and
--eviction policies (default: the runtime's own, as every command runs), --batching schedulers and
--rps-scale request rates is replayed in-process with the server's scheduler, each on a freshly loaded
model; or once against a running server (--url).
Writes requests.csv, ttft_cdf.png, tpot_cdf.png, latency_cdf.png, slo_vs_rate.png, summary.json and
summary.md (with the TTFT p99 ratio of static to continuous batching where both ran).

  moeinf replay demo --duration 60 --length-scale 0.25 --batching static continuous --rps-scale 1 2 4
  moeinf replay path/to/model --device-cache 25% --prefetch hybrid activation-aware --out replay-out
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import shlex
import sys
from typing import Any

from moeinf.commands import options
from moeinf.commands.serve import add_batching_arguments
from moeinf.config import EVICTION_POLICIES, PREFETCH_POLICIES
from moeinf.replay.workload import DEFAULT_PROMPTS, DEFAULT_TRACE
from moeinf.serve.batcher import BATCHING, MAX_BATCH

log = logging.getLogger(__name__)


def positive_float(text: str) -> float:
    value = options.non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_model_argument(parser, optional=True)
    parser.add_argument("--model", dest="model_flag", metavar="MODEL", type=options.model_dir, default=None,
                        help="deprecated spelling of the positional MODEL")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--trace", type=options.existing_file, default=str(DEFAULT_TRACE),
                          help="Azure LLM inference trace CSV")
    workload.add_argument("--prompts", nargs="+", type=options.existing_path, default=[str(DEFAULT_PROMPTS)],
                          help="prompt .jsonl files or directories")
    workload.add_argument(
        "--start-s", type=options.non_negative_float, default=0.0, help="skip this many seconds of the trace"
    )
    workload.add_argument(
        "--duration", type=positive_float, default=60.0, help="seconds of the trace to replay"
    )
    workload.add_argument(
        "--rps-scale",
        type=positive_float,
        nargs="+",
        default=[1.0],
        help="request-rate multipliers, each replayed (2 = twice the trace's rate)",
    )
    workload.add_argument(
        "--length-scale", type=positive_float, default=1.0, help="multiply prompt and output lengths"
    )
    workload.add_argument(
        "--max-new-tokens",
        type=options.positive_int,
        default=None,
        help="cap output lengths (default: the trace's, within the context window)",
    )
    workload.add_argument(
        "--max-new-tokens-cap", dest="max_new_tokens", type=options.positive_int, help=argparse.SUPPRESS
    )
    workload.add_argument("--seed", type=int, default=0, help="order in which prompt texts are used")
    parser.add_argument("--policies", default=None,
                        help="deprecated: comma-separated prefetch+eviction pairs; write --prefetch and "
                             "--eviction")
    add_batching_arguments(parser, compare=True)
    parser.add_argument(
        "--slo-s",
        type=positive_float,
        default=1.0,
        help="per-token latency SLO (end-to-end latency / output tokens), seconds",
    )
    options.add_threads_argument(parser)
    parser.add_argument("--url", default=None, help="replay against this running `moeinf serve` instead")
    parser.add_argument("--api-key", default=None, help="bearer key of the --url server")
    parser.add_argument("--model-name", default=None, type=options.model_name,
                        help="model id at --url (default: MODEL as named)")
    parser.add_argument("--out", default="replay-out", type=options.output_dir,
                        help="output directory")
    parser.add_argument("--json", action="store_true", help="print the per-run summary as JSON")
    options.add_offload_arguments(parser, no_offload=True, several_policies=True)


def model_of(args: argparse.Namespace) -> None:
    """MODEL from the positional or the deprecated --model (once), resolved into args.model_dir."""
    if args.model_flag is not None:
        if args.model_dir is not None:
            raise options.UsageError("give the model once: MODEL (--model is its old spelling)")
        log.warning("--model is deprecated; give the model as the first argument: moeinf replay MODEL ...")
        args.model_dir = args.model_flag
    if args.model_dir is None:
        raise options.UsageError("give the model: moeinf replay MODEL (a directory, a zoo name or a hub id)")
    args.model_dir = options.resolve_model(args.model_dir, revision=args.revision)


def policies(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The (prefetch, eviction) pairs to replay: every combination of --prefetch and --eviction, or the
    deprecated --policies, which cannot be mixed with them."""
    from moeinf.config import OffloadConfig

    if args.policies is None:
        return [(p, e) for p in dict.fromkeys(args.prefetch) for e in dict.fromkeys(args.eviction)]
    if args.prefetch != [OffloadConfig.prefetch] or args.eviction != [OffloadConfig.eviction]:
        raise options.UsageError("--policies and --prefetch/--eviction both choose policies; give "
                                 "--prefetch and --eviction only (--policies is deprecated)")
    log.warning("--policies is deprecated; write --prefetch P1 P2 --eviction E1 E2 (each combination runs)")
    return parse_policies(args.policies)


def parse_policies(text: str) -> list[tuple[str, str]]:
    """'a+b,c+d' -> [(prefetch, eviction), ...], validated against the config's policy names."""
    pairs = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        prefetch, sep, eviction = item.partition("+")
        if not sep or prefetch not in PREFETCH_POLICIES or eviction not in EVICTION_POLICIES:
            raise options.UsageError(
                f"--policies: {item!r} is not prefetch+eviction with prefetch in {list(PREFETCH_POLICIES)} "
                f"and eviction in {list(EVICTION_POLICIES)}"
            )
        pairs.append((prefetch, eviction))
    if not pairs:
        raise options.UsageError("--policies: give at least one prefetch+eviction pair")
    return pairs


def _flat_stats(stats: dict[str, Any]) -> dict[str, float]:
    keys = ("hits", "misses", "hit_rate", "stall_s", "prefetch_precision", "prefetch_recall", "bytes_read")
    return {k: stats[k] for k in keys if isinstance(stats.get(k), (int, float))}


def _advance(bar: Any, _result: object) -> None:
    bar.update(1)


def _workload(args: argparse.Namespace, rps_scale: float) -> list[Any]:
    from transformers import AutoConfig

    from moeinf.replay.workload import PromptPool, build_workload, load_prompts, load_trace, scale_rows
    from moeinf.serve.backend import context_length_of
    from moeinf.serve.loader import load_tokenizer

    try:
        rows = load_trace(args.trace, start_s=args.start_s, duration_s=args.duration)
        records = load_prompts(args.prompts)
    except (OSError, ValueError) as exc:
        raise options.UsageError(str(exc)) from None
    rows = scale_rows(
        rows, rps_scale=rps_scale, length_scale=args.length_scale, max_new_tokens_cap=args.max_new_tokens
    )
    pool = PromptPool(load_tokenizer(args.model_dir), records, seed=args.seed)
    return build_workload(
        rows, pool, context_length=context_length_of(AutoConfig.from_pretrained(args.model_dir))
    )


def run(args: argparse.Namespace) -> int:
    from moeinf.progress import progress_bar
    from moeinf.replay.report import markdown_table, summarize, write_report
    from moeinf.replay.runner import ServerError, check_server, replay_local, replay_remote
    from moeinf.serve.loader import load_backend

    model_of(args)
    pairs = policies(args)
    workloads = {rate: _workload(args, rate) for rate in args.rps_scale}
    model_name = args.model_name or args.model_dir.ref.name
    if args.url:
        try:
            check_server(args.url, model_name, args.api_key)
        except ServerError as exc:
            raise options.UsageError(str(exc)) from None
        configs: list[tuple[str, Any]] = [("server", None)]
        schedulers = ["server"]
    elif args.no_offload:
        configs, schedulers = [("transformers", None)], list(dict.fromkeys(args.batching))
    else:
        configs = [
            (f"{p}+{e}", options.offload_config(args, args.model_dir, prefetch=p, eviction=e))
            for p, e in pairs
        ]
        schedulers = list(dict.fromkeys(args.batching))
        options.ensure_store(args.model_dir, configs[0][1], progress=True)

    # each scheduler with its own default row limit unless --max-batch sets one for all
    max_batch = {b: args.max_batch or MAX_BATCH[b] for b in BATCHING}
    by_run, summary = {}, {}
    total = sum(len(items) for items in workloads.values()) * len(configs) * len(schedulers)
    bar = progress_bar(total, unit="req", desc="replay")
    # rate by rate, the schedulers back to back: both meet about the same machine load at each rate
    for policy, config in configs:
        for rate, items in workloads.items():
            for batching in schedulers:
                label = _label(policy, batching, rate, len(configs) > 1)
                bar.set_postfix_str(label)
                progress = functools.partial(_advance, bar)
                if args.url:
                    results = replay_remote(
                        args.url,
                        items,
                        model=model_name,
                        api_key=args.api_key,
                        policy=label,
                        progress=progress,
                    )
                    stats: dict[str, Any] = {}
                else:
                    backend = load_backend(args.model_dir, config)
                    try:
                        results = replay_local(
                            backend,
                            items,
                            policy=label,
                            max_batch=max_batch[batching],
                            max_wait_s=args.max_wait_s,
                            join_wait_s=args.join_wait_s,
                            join_hold_tokens=args.join_hold_tokens,
                            join_min_rows=args.join_min_rows,
                            prefill_padding=args.prefill_padding,
                            batching=batching,
                            progress=progress,
                        )
                        stats = backend.stats()
                    finally:
                        backend.close()
                by_run[label] = results
                summary[label] = summarize(results, slo_s=args.slo_s) | {
                    "policy": policy,
                    "batching": batching,
                    "max_batch": None if args.url else max_batch[batching],
                    "rps_scale": rate,
                    "runtime": _flat_stats(stats),
                }
    bar.close()
    meta = {
        "command": "moeinf " + shlex.join(getattr(args, "argv", None) or ["replay"]),
        "model": args.model_dir.ref.name,
        "policies": [policy for policy, _ in configs],
        "trace": args.trace,
        "duration_s": args.duration,
        "start_s": args.start_s,
        "rps_scale": args.rps_scale,
        "length_scale": args.length_scale,
        "max_new_tokens": args.max_new_tokens,
        "requests": {str(rate): len(items) for rate, items in workloads.items()},
        "max_batch": args.max_batch or {b: max_batch[b] for b in schedulers if b in BATCHING},
        "max_wait_s": args.max_wait_s,
        "join_wait_s": args.join_wait_s,
        "join_hold_tokens": args.join_hold_tokens,
        "join_min_rows": args.join_min_rows,
        "prefill_padding": args.prefill_padding,
        "threads": None if args.url else torch_threads(),
        "device_cache": str(configs[0][1].device_cache) if configs[0][1] is not None else None,
    }
    out = write_report(args.out, by_run, summary, meta, slo_s=args.slo_s)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(markdown_table(summary))
        print(f"\nwritten to {out}/: requests.csv, the plots, summary.json and summary.md")
    failed = {label: s["failed"] for label, s in summary.items() if s["failed"]}
    if failed:
        first = next(r.error for results in by_run.values() for r in results if r.error)
        print(
            f"moeinf replay: error: {sum(failed.values())} requests failed ({', '.join(failed)}); "
            f"the first: {first}",
            file=sys.stderr,
        )
        return options.EXIT_FAILURE
    return options.EXIT_OK


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _label(policy: str, batching: str, rate: float, several_policies: bool) -> str:
    label = f"{batching} x{rate:g}"
    return f"{policy} {label}" if several_policies else label
