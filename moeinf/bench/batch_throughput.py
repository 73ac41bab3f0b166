"""Offline batch throughput: `moeinf batch`'s planned batches against the other ways to answer N prompts.

Batch rows run `moeinf batch`'s engine (`moeinf.batch.runner.run_continuous`: the server's running batch
without the server). All rows answer held-out prompts of the zoo corpus with greedy decoding of exactly
--new-tokens tokens (EOS ignored) at the same expert memory (--device-cache, a share of the expert bytes),
and report tokens/s (generated tokens over wall time, prefill and any routing pass included) and expert
bytes read per generated token:

- `batch-plan`: the planner's chosen plan over all --prompts (length order), beside its prediction;
- `batch-route` / `batch-arrival`: the same plan with route-aware grouping and in file order
  (--group-prompts prompts);
- `grid-B-pipeline|nopipe`: other plans (--grid batch sizes, prefetch on and off), each on --grid-prompts
  prompts, beside the planner's prediction for exactly that run;
- `one-at-a-time`: batch size 1 (the offloaded model as `moeinf generate` runs it) on --one-prompts;
- `serve-continuous`: `moeinf serve`'s continuous batcher (moeinf.serve.batcher, its default max batch)
  with all --serve-prompts submitted at once (full load);
- `accelerate`: HuggingFace + accelerate disk offload with the same DRAM for experts
  (moeinf.bench.accelerate_baseline's device map), one padded batch of --accelerate-prompts prompts, the
  offload files evicted from the page cache before every step (eviction time excluded).

  moeinf bench batch-throughput --model DIR --offload-dir STORE --prompts 256 --new-tokens 64 --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from moeinf.bench.common import machine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (e.g. the inflated e2e model)")
    parser.add_argument("--offload-dir", default=None, help="its expert store (default: the model's)")
    parser.add_argument("--eamc", default=None, help="EAMC of the model (route grouping, popularity)")
    parser.add_argument("--device-cache", default="25%", help="expert cache budget")
    parser.add_argument("--prompts", type=int, default=256, help="prompts of the planned batch run")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--prompt-chars", type=int, default=200, help="prompts cut to this many characters")
    parser.add_argument(
        "--group-prompts",
        type=int,
        default=None,
        help="prompts of the grouping comparison (default: --prompts)",
    )
    parser.add_argument("--grid", default="8,32,64", help="batch sizes of the other measured plans")
    parser.add_argument(
        "--grid-prompts",
        type=int,
        default=None,
        help="prompts of each grid plan (default: 2 batches of its size, at most --prompts)",
    )
    parser.add_argument("--one-prompts", type=int, default=4, help="prompts answered one at a time")
    parser.add_argument(
        "--serve-prompts",
        type=int,
        default=None,
        help="prompts sent to serve's batcher (default: --prompts); 0 skips it",
    )
    parser.add_argument(
        "--accelerate-prompts", type=int, default=8, help="rows of accelerate's batch; 0 skips"
    )
    parser.add_argument(
        "--skip", default="", help="comma-separated row kinds to skip: plan, group, grid, one"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="run this batch size instead of the planner's choice (its prediction beside)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every row (all peers alike)")
    parser.add_argument("--out", default=None, help="write batch_throughput.jsonl in this directory")


def _drive_gbps(model: Path, config: Any) -> float:
    """The drive's rate now through the runtime's reader (GB/s): the drive is shared and drifts, so each
    row records it before and after its run."""
    from moeinf.batch.roofline import drive_bandwidth
    from moeinf.builder import store_plan

    store_dir, _ = store_plan(model, config)
    return round(drive_bandwidth(store_dir, io_threads=config.io_threads) / 1e9, 3)


def _measure(
    model: Path,
    config: Any,
    plan: Any,
    prompts: list[Any],
    lengths: dict[Any, int],
    order: str,
    new_tokens: int,
    tokenizer: Any,
) -> dict[str, Any]:
    from moeinf.batch.grouping import order_prompts
    from moeinf.batch.runner import run_continuous
    from moeinf.serve.backend import SamplingParams
    from moeinf.serve.loader import load_backend

    drive_before = _drive_gbps(model, config)
    backend = load_backend(model, plan.apply(config))
    try:
        moe = backend.forward
        start = time.perf_counter()
        ordered = order_prompts(prompts, order, lengths=lengths, batch_size=plan.batch_size, model=moe)
        order_s = time.perf_counter() - start
        moe.reset_stats()
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        result = run_continuous(
            backend.open_batch, tokenizer, ordered, plan.batch_size, params, join=plan.join_rows
        )
        stats = moe.stats()
    finally:
        backend.close()
    seconds = order_s + result.seconds
    return {
        "prompts": result.prompts,
        "tokens": result.tokens,
        "seconds": round(seconds, 3),
        "order_s": round(order_s, 3),
        "tokens_per_s": result.tokens / seconds,
        "bytes_read_per_token": stats["bytes_read"] / max(result.tokens, 1),
        "hit_rate": stats.get("hit_rate"),
        **{k: round(float(stats[k]), 3) for k in ("stall_s", "prefill_s", "decode_s") if k in stats},
        "forward_passes": stats.get("forward_passes"),
        **{k: stats.get(k) for k in ("prefetches", "useful_prefetches", "demand_reads", "unused_evictions")},
        "drive_gbps_before": drive_before,
        "drive_gbps_after": _drive_gbps(model, config),
    }


def _serve(model: Path, config: Any, texts: list[str], new_tokens: int, tokenizer: Any) -> dict[str, Any]:
    from moeinf.serve.backend import SamplingParams
    from moeinf.serve.batcher import Batcher
    from moeinf.serve.loader import load_backend

    drive_before = _drive_gbps(model, config)
    backend = load_backend(model, config)
    batcher = Batcher(backend, max_queue=len(texts))
    finished = threading.Semaphore(0)

    def sink(event: Any) -> None:
        if event.finish_reason is not None or event.error is not None:
            finished.release()

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    try:
        batcher.start()
        start = time.perf_counter()
        handles = [batcher.submit(tokenizer.encode(t), params, (), sink) for t in texts]
        for _ in handles:
            finished.acquire()
        seconds = time.perf_counter() - start
        stats = backend.stats()
    finally:
        batcher.close()
        backend.close()
    tokens = sum(h.completion_tokens for h in handles)
    return {
        "prompts": len(texts),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": tokens / seconds,
        "bytes_read_per_token": stats.get("bytes_read", 0) / max(tokens, 1),
        "max_batch": batcher.max_batch,
        "stall_s": round(float(stats.get("stall_s", 0.0)), 3),
        "drive_gbps_before": drive_before,
        "drive_gbps_after": _drive_gbps(model, config),
    }


def _accelerate(
    model: Path, cache: float, texts: list[str], new_tokens: int, tokenizer: Any
) -> dict[str, Any]:
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    from moeinf.batch.runner import pad_batch, pad_id_of

    from .accelerate_baseline import DecodeClock, drop_page_cache, plan_device_map

    device_map, _plan = plan_device_map(model, cache)
    with tempfile.TemporaryDirectory(prefix="moeinf-accelerate-") as folder:
        hf = AutoModelForCausalLM.from_pretrained(model, device_map=device_map, offload_folder=folder).eval()
        files = sorted(p for p in [*Path(folder).rglob("*"), *model.glob("*.safetensors")] if p.is_file())
        pad = pad_id_of(tokenizer, hf.config)
        ids, mask = pad_batch([tokenizer.encode(t) for t in texts], pad)
        clock = DecodeClock(files)
        drop_page_cache(files)
        with torch.inference_mode():
            start = time.perf_counter()
            hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
                logits_processor=LogitsProcessorList([clock]),
            )
            seconds = time.perf_counter() - start - sum(clock.drop_seconds)
        del hf
    tokens = len(texts) * new_tokens
    return {
        "prompts": len(texts),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": tokens / seconds,
    }


def run(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from moeinf.api import pack_store
    from moeinf.batch import planner
    from moeinf.batch.jobs import Prompt
    from moeinf.bench.e2e import heldout_texts
    from moeinf.config import OffloadConfig
    from moeinf.hf.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    model = Path(args.model)
    config = OffloadConfig(device_cache=args.device_cache, offload_dir=args.offload_dir, eamc=args.eamc)
    pack_store(model, config)
    tokenizer, _ = load_tokenizer(model)
    texts = [t[: args.prompt_chars] for t in heldout_texts(args.prompts, args.seed)]
    prompts = [Prompt(i, t) for i, t in enumerate(texts)]
    lengths = {p.id: len(tokenizer.encode(p.prompt)) for p in prompts}
    skip = set(filter(None, args.skip.split(",")))

    def workload(subset: list[Any], order: str = "length") -> planner.Workload:
        run_order = [lengths[p.id] for p in subset]  # arrival; route order is not known before its pass
        return planner.Workload(
            len(subset),
            sum(run_order) / len(subset),
            args.new_tokens,
            tuple(sorted(run_order) if order == "length" else run_order),
        )

    from moeinf.api import MoE
    from moeinf.batch.runner import pad_id_of

    with MoE(model, config) as moe:  # the planner's prefill probe (prompts of the median length)
        by_length = sorted(prompts, key=lambda p: lengths[p.id])
        middle = max(len(by_length) // 2 - planner.PROBE_ROWS // 2, 0)
        probe = [tokenizer.encode(p.prompt) for p in by_length[middle : middle + planner.PROBE_ROWS]]
        choice = planner.choose(
            model,
            config,
            workload(prompts),
            moe=moe,
            probe_rows=probe,
            pad_id=pad_id_of(tokenizer, moe.model.config),
        )
    header = {
        "bench": "batch-throughput",
        "model": str(model),
        "device_cache": args.device_cache,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "prompt_chars": args.prompt_chars,
        "mean_prompt_tokens": workload(prompts).prompt_tokens,
        "rates": dataclasses.asdict(choice.rates),
        "chosen": planner.summary(choice),
        "machine": machine(),
    }
    out = Path(args.out) / "batch_throughput.jsonl" if args.out else None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(header) + "\n")
    print(json.dumps(header), flush=True)
    rows: list[dict[str, Any]] = []

    def record(
        name: str,
        row: dict[str, Any],
        plan: Any = None,
        subset: list[Any] | None = None,
        order: str = "length",
    ) -> None:
        if plan is not None:
            work = workload(subset or prompts, order)
            predicted_plan = choice.predict(work, plan)
            predicted = predicted_plan.predicted_tokens_per_s
            # the same model fed the drive's rate measured right before this row (the drive drifts)
            at_row = dataclasses.replace(
                choice, rates=dataclasses.replace(choice.rates, drive_bps=row["drive_gbps_before"] * 1e9)
            )
            predicted_now = at_row.predict(work, plan).predicted_tokens_per_s
            b = predicted_plan.breakdown
            row = {
                **row,
                "batch_size": plan.batch_size,
                "pipeline": plan.pipeline,
                "kernel": plan.kernel,
                "join": plan.join_rows,
                "predicted_prefill_s": b["job_prefill_s"],
                "predicted_decode_s": b["job_decode_s"],
                "predicted_step_s": {k: b[k] for k in ("step_s", "step_io_s", "step_experts_s",
                                                       "step_verify_s", "step_dense_s")},
                "predicted_tokens_per_s": predicted,
                "predicted_over_measured": predicted / row["tokens_per_s"],
                "predicted_at_row_drive": predicted_now,
                "predicted_at_row_drive_over_measured": predicted_now / row["tokens_per_s"],
            }
        row = {"row": name, **row}
        rows.append(row)
        if out is not None:
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    plan = choice.plan
    if args.batch_size:
        size = min(args.batch_size, args.prompts)
        plan = planner.best_of(choice.plans, size, True) or dataclasses.replace(plan, batch_size=size, join=0)
    if "plan" not in skip:
        record(
            "batch-plan",
            _measure(model, config, plan, prompts, lengths, "length", args.new_tokens, tokenizer),
            plan,
        )
    if "one" not in skip:
        one = dataclasses.replace(plan, batch_size=1, pipeline=True, join=0)
        subset = prompts[: args.one_prompts]
        record(
            "one-at-a-time",
            _measure(model, config, one, subset, lengths, "arrival", args.new_tokens, tokenizer),
            one,
            subset,
            "arrival",
        )
    serve_n = args.prompts if args.serve_prompts is None else args.serve_prompts
    if serve_n:
        record("serve-continuous", _serve(model, config, texts[:serve_n], args.new_tokens, tokenizer))
    if "group" not in skip:
        group = prompts[: args.group_prompts or args.prompts]
        for order in ("route", "arrival"):
            record(
                f"batch-{order}",
                _measure(model, config, plan, group, lengths, order, args.new_tokens, tokenizer),
                plan,
                group,
                "length" if order == "route" else order,
            )
    if "grid" not in skip:
        for b in (int(x) for x in args.grid.split(",") if x):
            subset = prompts[: min(args.grid_prompts or 2 * b, args.prompts)]
            for pipeline in (True, False):
                grid_plan = planner.best_of(choice.plans, b, pipeline) or dataclasses.replace(
                    plan, batch_size=b, pipeline=pipeline, join=0
                )
                record(
                    f"grid-{b}-{'pipeline' if pipeline else 'nopipe'}",
                    _measure(model, config, grid_plan, subset, lengths, "length", args.new_tokens, tokenizer),
                    grid_plan,
                    subset,
                )
    if args.accelerate_prompts:
        from moeinf.config import resolve_bytes

        share = resolve_bytes(args.device_cache, 10**12, field="device_cache") / 10**12
        record(
            "accelerate",
            _accelerate(model, share, texts[: args.accelerate_prompts], args.new_tokens, tokenizer),
        )
    print(table(rows), file=sys.stderr)
    return 0


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| row | prompts | tokens/s | predicted | pred/meas | at row's drive | pred/meas "
        "| bytes read/token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pred = r.get("predicted_tokens_per_s")
        predicted = "" if pred is None else f"{pred:.2f}"
        ratio = "" if pred is None else f"{r['predicted_over_measured']:.2f}"
        now = r.get("predicted_at_row_drive")
        at_row = "" if now is None else f"{now:.2f} | {r['predicted_at_row_drive_over_measured']:.2f}"
        lines.append(
            f"| {r['row']} | {r['prompts']} | {r['tokens_per_s']:.2f} | {predicted} | {ratio} | "
            f"{at_row or ' | '} | "
            f"{r.get('bytes_read_per_token', 0) / 2**20:.1f} MiB |"
        )
    return "\n".join(lines)
