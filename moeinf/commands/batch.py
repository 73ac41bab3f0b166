"""Answer a file of prompts offline, in big batches, for the most tokens per second.

  moeinf batch MODEL_DIR --prompts prompts.jsonl --out answers.jsonl --device-cache 25%
  moeinf batch MODEL_DIR --prompts prompts.jsonl --out answers.jsonl --plan      # show the plan only

Each line of --prompts is a JSON object with `id` and `prompt`; each line of --out gets `id`, `text` and
`tokens` (the answer's length). Answers are appended and fsynced as each batch finishes: run the same
command again after a crash or a kill and it answers only what is missing (each id exactly once). The
settings that shape an answer are recorded in ANSWERS.jsonl.settings.json: a rerun with other ones (another
--max-new-tokens, temperature, model or store precision) is refused rather than mixing two jobs in one file.

The batch size and the knobs come from a plan: a roofline model of this machine (drive and memory
bandwidth, expert compute rates, measured once and cached under $MOEINF_CACHE/batch) predicts tokens/s
for each candidate plan within the memory budget, and the best is run (`--plan` prints the candidates).
--batch-size fixes the batch size instead. --order route groups prompts whose routing is alike, so
that each batch touches fewer experts (fewer bytes read when the cache is small).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from moeinf.commands import options

ORDERS = ("arrival", "length", "route")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_model_argument(parser)
    parser.add_argument("--prompts", required=True, metavar="FILE.jsonl",
                        help="JSON lines, each with 'id' and 'prompt'")
    parser.add_argument("--out", required=True, metavar="ANSWERS.jsonl",
                        help="answers file, appended (a rerun skips the ids already in it)")
    parser.add_argument("--batch-size", type=options.positive_int, default=None, metavar="N",
                        help="prompts generated together (default: the planner's choice)")
    parser.add_argument("--order", choices=ORDERS, default="length",
                        help="order of the prompts into batches: file order, by length (less padding), or "
                             "route-aware (prompts routed alike share a batch; one cheap routing pass first)")
    parser.add_argument("--plan", action="store_true",
                        help="print the chosen plan and its predicted tokens/s, then stop")
    parser.add_argument("--progress-every", type=options.non_negative_float, default=10.0, metavar="S",
                        help="seconds between progress lines when stderr is not a terminal")
    options.add_generation_arguments(parser, temperature=0.0, stop=False)
    options.add_offload_arguments(parser)


def answer_settings(args: argparse.Namespace) -> dict[str, object]:
    """What shapes an answer, by the flags that set it, recorded beside the answers file
    (`Answers.check_settings`); greedy answers (temperature 0) do not depend on the sampling flags."""
    settings: dict[str, object] = {"MODEL": str(Path(args.model_dir).resolve()),
                                   "--max-new-tokens": args.max_new_tokens, "--temperature": args.temperature,
                                   "--repetition-penalty": args.repetition_penalty, "--dtype": args.dtype,
                                   "--quant": args.quant, "--quant-dense": args.quant_dense}
    if args.temperature > 0:
        settings.update({"--top-p": args.top_p, "--top-k": args.top_k, "--seed": args.seed})
    return settings


def run(args: argparse.Namespace) -> int:
    from moeinf.batch import planner
    from moeinf.batch.jobs import Answers, JobError, read_prompts
    from moeinf.batch.runner import Progress, run_continuous
    from moeinf.hf.tokenizer import load_tokenizer

    try:
        prompts = read_prompts(args.prompts)
    except JobError as exc:
        raise options.UsageError(str(exc)) from None
    options.check_output_file("--out", args.out, example="answers.jsonl")  # a foreign file: Answers says so
    # the prompts fit the model before --out is touched (opening it records the job's settings)
    tokenizer, _kind = load_tokenizer(args.model_dir)
    lengths = {p.id: len(tokenizer.encode(p.prompt, verbose=False)) for p in prompts}  # checked below
    empty = [key for key, n in lengths.items() if n == 0]
    if empty:
        raise options.UsageError(f"prompt {empty[0]!r} encodes to no tokens; give some text")
    longest = max(lengths.values())
    options.check_context(args.model_dir, longest, args.max_new_tokens)
    if not args.plan:  # before the model loads: a file of another job, or one already complete
        try:
            with Answers(args.out) as answers:
                answers.check_settings(answer_settings(args))
                done = set(answers.done)
        except JobError as exc:
            raise options.UsageError(str(exc)) from None
        if answers.dropped_partial:
            print(f"{args.out}: dropped a partial last line (an interrupted write); its prompt runs again",
                  file=sys.stderr)
        unknown = done - {p.id for p in prompts}
        if unknown:
            raise options.UsageError(f"{args.out} holds answers to ids not in {args.prompts} (e.g. "
                                     f"{sorted(map(str, unknown))[0]!r}); give another --out")
        if all(p.id in done for p in prompts):
            print(f"all {len(prompts)} prompts are answered in {args.out}", file=sys.stderr)
            return 0
    config = options.offload_config(args, args.model_dir)
    # the prompt lengths in the order batches take them (route order is not known yet: file order)
    run_order = sorted(lengths.values()) if args.order == "length" else [lengths[p.id] for p in prompts]
    workload = planner.Workload(prompts=len(prompts), prompt_tokens=sum(lengths.values()) / len(prompts),
                                new_tokens=args.max_new_tokens, lengths=tuple(run_order))
    options.ensure_store(args.model_dir, config, progress=sys.stderr.isatty())
    from moeinf.batch.runner import pad_id_of
    from moeinf.serve.loader import load_backend

    backend = load_backend(args.model_dir, config)
    try:
        moe = backend.forward
        # the prefill's CPU rate is measured on a prefill of prompts of the job's median length
        by_length = sorted(prompts, key=lambda p: lengths[p.id])
        middle = max(len(by_length) // 2 - planner.PROBE_ROWS // 2, 0)
        probe = by_length[middle:middle + planner.PROBE_ROWS]
        plan = planner.choose(args.model_dir, config, workload, batch_size=args.batch_size, moe=moe,
                              probe_rows=[tokenizer.encode(p.prompt) for p in probe],
                              pad_id=pad_id_of(tokenizer, moe.model.config))
    finally:
        backend.close()
    if args.plan:
        print(planner.describe(plan))
        return 0
    try:
        answers = Answers(args.out)
    except JobError as exc:
        raise options.UsageError(str(exc)) from None
    with answers:
        pending = answers.pending(prompts)
        if len(pending) < len(prompts):
            print(f"resuming: {len(prompts) - len(pending)} of {len(prompts)} prompts already answered",
                  file=sys.stderr)
        config = plan.apply(config)
        print(f"plan: {planner.summary(plan)}", file=sys.stderr)
        from moeinf.batch.grouping import order_prompts
        from moeinf.serve.backend import SamplingParams
        from moeinf.serve.loader import load_backend

        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k,
                                repetition_penalty=args.repetition_penalty, seed=args.seed)
        backend = load_backend(args.model_dir, config)
        try:
            moe = backend.forward
            ordered = order_prompts(pending, args.order, lengths=lengths, batch_size=plan.batch_size,
                                    model=moe)
            moe.reset_stats()
            progress = Progress(len(pending), every_s=args.progress_every)
            start = time.perf_counter()
            result = run_continuous(backend.open_batch, tokenizer, ordered, plan.batch_size, params, answers,
                                    progress, join=plan.plan.join_rows)
            elapsed = time.perf_counter() - start
            stats = moe.stats()
        finally:
            backend.close()
    report = {"prompts": result.prompts, "tokens": result.tokens, "seconds": round(elapsed, 3),
              "tokens_per_s": round(result.tokens / elapsed, 3) if elapsed > 0 else None,
              "predicted_tokens_per_s": round(plan.predicted_tokens_per_s, 3),
              "bytes_read_per_token": round(stats["bytes_read"] / max(result.tokens, 1)),
              "batch_size": plan.batch_size, "order": args.order}
    print(f"-- {options.speed_line(stats)}", file=sys.stderr)
    print(f"-- {json.dumps(report)}", file=sys.stderr)
    return 0
