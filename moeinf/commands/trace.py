"""Generate on prompt sets with the unmodified HuggingFace model, record which experts every sequence
activates (prompt and generated tokens), and build an EAMC by K-Means (Eq. 1).

  moeinf trace MODEL_DIR --prompts moeinf/data/prompts/gsm8k_test.jsonl moeinf/data/prompts/mt_bench.jsonl \\
      --out traces/model.eamc --capacity 300 --max-new-tokens 64 --limit 200

Prompts are JSONL lines {"prompt"}, with optional "id" (default: file and line) and "task". The
tokenizer is MODEL_DIR's own, or a byte-level fallback when the directory has none (see
moeinf/hf/tokenizer.py); the command says which. A capacity above the number of distinct traced sequences
is clamped to that number, with a warning; the EAMC file records the requested and the effective capacity.

With `--lookahead-depth D` (3 by default) it also records every token's router inputs and fits the learned
look-ahead predictor (an MLP per layer over its router input and routing, `moeinf/trace/lookahead_fit.py`),
written beside the EAMC as `X.lookahead.safetensors`, where `OffloadConfig(lookahead_predictor="auto")`
finds it; its slot recall and precision on the held-out prompts (`--lookahead-held-out`) are printed.

From the same routing it counts the expert transitions between layers (which experts layers l+1..l+D
route a token to, given its experts at layer l: `moeinf.policy.lookahead.Transitions`) and writes them
beside the EAMC as `X.transitions.npz`, where the look-ahead finds them: they predict from the routing
alone where no router can run ahead (a router that needs its block's state, replayed routing).

It also fits the eviction policy to the traced requests' routing (`moeinf/policy/fitted.py`: the score's
constants per cache size, chosen by replaying them) and writes it beside the EAMC as `X.eviction.json`,
which `OffloadConfig(eviction="fitted")` reads (`--no-eviction-fit`: skip).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeinf.commands import options

if TYPE_CHECKING:
    from ..trace.collect import Collected

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_model_argument(parser)
    parser.add_argument("--prompts", nargs="+", required=True, metavar="FILE.jsonl",
                        type=options.existing_file,
                        help='prompt files, one {"prompt"} per line, with optional "id" and "task" (see '
                             'moeinf/data/prompts)')
    parser.add_argument("--out", required=True, metavar="FILE.eamc", help="EAMC file to write")
    parser.add_argument("--capacity", type=options.positive_int, default=300, help="EAMC entries (K-Means k)")
    parser.add_argument("--max-new-tokens", type=options.positive_int, default=32, metavar="N",
                        help="tokens generated per prompt (shorter than an answer's default: a trace records "
                             "routing)")
    parser.add_argument("--limit", type=options.positive_int, default=None, metavar="K",
                        help="at most K prompts from each file (default: all)")
    parser.add_argument("--batch-size", type=options.positive_int, default=8, metavar="B",
                        help="prompts per generate() call")
    parser.add_argument("--max-prompt-tokens", type=options.positive_int, default=256,
                        help="keep at most this many leading tokens of each prompt")
    parser.add_argument("--temperature", type=options.non_negative_float, default=0.0, metavar="T",
                        help="sampling temperature; 0 = greedy (the most likely token every step)")
    parser.add_argument("--sample", action=options.Deprecated, nargs=0, const=1.0, dest="temperature",
                        replacement="--temperature 1")
    options.add_threads_argument(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of sampling and K-Means")
    parser.add_argument("--raw-out", metavar="FILE.jsonl",
                        help="also write the raw routing (expert ids and gate weights per token) as JSONL")
    parser.add_argument("--lookahead-depth", type=options.non_negative_int, default=3, metavar="D",
                        help="fit the learned look-ahead predictor for D layers ahead (0: do not fit one)")
    parser.add_argument("--lookahead-held-out", type=options.share, default=0.2, metavar="SHARE",
                        help="share of the prompts held out to score the look-ahead predictor")
    parser.add_argument("--no-eviction-fit", dest="eviction_fit", action="store_false",
                        help="do not fit the eviction policy to the traced requests (by default it is fitted "
                        "and written beside the EAMC as X.eviction.json, used by eviction='fitted')")
    parser.add_argument("--json", action="store_true", help="print one JSON object with the results")


def is_eamc(path: Path) -> bool:
    """Whether `path` is an EAMC file (which a new trace may replace)."""
    from ..trace.eamc import EAMC

    try:
        EAMC.load(path)
    except Exception:  # noqa: BLE001 (any reason it does not load: it is not one)
        return False
    return True


def is_raw_trace(path: Path) -> bool:
    """Whether `path` starts as a raw routing trace (`--raw-out`) does."""
    from ..trace.rawtrace import read_raw

    try:
        next(iter(read_raw(path)), None)
    except Exception:  # noqa: BLE001
        return False
    return True


def run(args: argparse.Namespace) -> int:
    from ..store.fingerprint import fingerprint
    from ..trace.collect import build_eamc, collect, read_prompts
    from ..trace.lookahead_fit import predictor_path
    from ..trace.rawtrace import write_raw

    started = time.perf_counter()
    try:
        prompts = read_prompts(args.prompts, args.limit)
    except ValueError as exc:
        raise options.UsageError(str(exc)) from None
    if not prompts:
        raise options.UsageError(f"no prompt in {', '.join(args.prompts)}: give JSONL files with one "
                                 '{"prompt": ...} object per line')
    options.check_output_file("--out", args.out, example="model.eamc", ours=is_eamc, what="an EAMC")
    limit = options.context_length(args.model_dir)
    # prompts are cut to --max-prompt-tokens; one at or above the context means "no cut": then only the
    # answers' length is checked here, and a prompt too long for it fails as generate's would
    if limit is not None:
        cut = args.max_prompt_tokens < limit
        prompt = args.max_prompt_tokens if cut else 1
        if prompt + args.max_new_tokens > limit:
            room = (f"with prompts of up to {prompt} tokens (--max-prompt-tokens) exceeds" if cut
                    else "leaves no room for a prompt in")
            raise options.UsageError(f"--max-new-tokens {args.max_new_tokens} {room} the model's context of "
                                     f"{limit} tokens; use --max-new-tokens {limit - prompt} or less")
    if args.raw_out:
        if Path(args.raw_out).resolve() == Path(args.out).resolve():
            raise options.UsageError(f"--raw-out and --out both name {args.out}; give the raw routing a "
                                     "file of its own, e.g. routing.jsonl.gz")
        options.check_output_file("--raw-out", args.raw_out, example="routing.jsonl", ours=is_raw_trace,
                                  what="a raw routing trace")
    collected = collect(args.model_dir, prompts, max_new_tokens=args.max_new_tokens,
                        batch_size=args.batch_size, max_prompt_tokens=args.max_prompt_tokens,
                        sample=args.temperature > 0, temperature=args.temperature or 1.0,
                        seed=args.seed, raw=args.raw_out is not None or args.eviction_fit,
                        progress=not args.json, hidden=args.lookahead_depth > 0)
    if not args.json:
        print("tokenizer: byte-level fallback (MODEL_DIR has no tokenizer files)"
              if collected.tokenizer == "byte-fallback" else "tokenizer: MODEL_DIR's own")
    meta = {"fingerprint": fingerprint(args.model_dir), "model": Path(args.model_dir).resolve().name,
            "max_new_tokens": args.max_new_tokens, "sample": args.temperature > 0,
            "temperature": args.temperature}
    eamc = build_eamc(collected, args.capacity, seed=args.seed, meta=meta)
    out = eamc.save(args.out)
    if args.raw_out:
        write_raw(args.raw_out, collected.raw)
    eviction = fit_eviction_beside(collected, out, args.seed) if args.eviction_fit else None
    transitions = None
    if args.lookahead_depth > 0 and collected.raw and collected.num_layers > 1:
        transitions = fit_transitions_beside(collected, out, args.lookahead_depth, meta["fingerprint"])
    lookahead = None
    if args.lookahead_depth > 0 and collected.hidden is not None:
        lookahead = fit_lookahead(collected, args.lookahead_depth, args.lookahead_held_out,
                                  predictor_path(out), dict(meta, seed=args.seed))
    result = {"num_sequences": len(prompts), "capacity": eamc.capacity, "capacity_requested": args.capacity,
              "layers": collected.num_layers, "experts": collected.num_experts, "top_k": collected.top_k,
              "tokens": collected.tokens, "out": str(out), "raw_out": args.raw_out,
              "tokenizer": collected.tokenizer, "fingerprint": meta["fingerprint"], "lookahead": lookahead,
              "eviction": eviction, "transitions": transitions,
              "elapsed": round(time.perf_counter() - started, 3)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"traced {result['num_sequences']} sequences ({result['tokens']} tokens, "
              f"{result['layers']} MoE layers x {result['experts']} experts) in {result['elapsed']} s; "
              f"EAMC of {result['capacity']} entries -> {out}"
              + (f"; raw routing -> {args.raw_out}" if args.raw_out else ""))
        if eviction is not None:
            print(f"eviction policy fitted on {eviction['requests']} requests ({eviction['fit_s']} s) -> "
                  f"{eviction['out']}")
        if transitions is not None:
            print(f"expert transitions ({transitions['depth']} layers ahead, joining "
                  f"{transitions['layers_joined']} layers of a token) -> {transitions['out']}")
        if lookahead is not None:
            quality = ", ".join(f"depth {d}: recall {q['recall']:.3f} precision {q['precision']:.3f}"
                                for d, q in lookahead["held_out"].items())
            print(f"look-ahead predictor ({lookahead['tokens']} tokens, {lookahead['fit_s']} s) -> "
                  f"{lookahead['out']}" + (f"; held out: {quality}" if quality else ""))
    return 0


def fit_lookahead(collected: Collected, depth: int, held_out: float, out: Path,
                  meta: dict[str, Any]) -> dict[str, Any]:
    """Fit and save the learned look-ahead predictor; its held-out slot quality at the default threshold
    (no held-out set when a single prompt was traced)."""
    from ..config import OffloadConfig
    from ..trace import lookahead_fit

    records = collected.hidden
    several = len(set(records.sequence.tolist())) > 1
    train, test = records.split(held_out, seed=meta["seed"]) if held_out > 0 and several else (records, None)
    started = time.perf_counter()
    maps = lookahead_fit.fit(train, collected.num_experts, depth, seed=meta["seed"])
    elapsed = round(time.perf_counter() - started, 1)
    threshold = OffloadConfig.prefetch_min_probability
    lookahead_fit.save(maps, out, dict(meta, held_out=held_out, threshold=threshold))
    quality = {}
    if test is not None:
        quality = lookahead_fit.slot_quality(maps.predict, test, collected.num_experts, depth, threshold)
    return {"out": str(out), "tokens": maps.meta["tokens"], "fit_s": elapsed, "threshold": threshold,
            "held_out": quality}


def fit_transitions_beside(collected: Collected, out: Path, depth: int, fingerprint: str) -> dict[str, Any]:
    """Count the expert transitions of the traced routing (`moeinf.policy.lookahead.Transitions`) and write
    them beside the EAMC, where the look-ahead loads them."""
    import numpy as np

    from ..policy.lookahead import JOINED, Transitions
    from ..runtime.lookahead import save_transitions, transitions_path

    layers = collected.num_layers
    routings = []
    for trace in collected.raw:
        # each step's tokens, every MoE layer's k ids: [T, L, k] (a layer a step did not route stays -1)
        for step in trace.steps:
            tokens = max((ids.shape[0] for ids, _ in step.values()), default=0)
            ids = np.full((tokens, layers, collected.top_k), -1, dtype=np.int64)
            for layer, (routed, _) in step.items():
                ids[: routed.shape[0], layer, : routed.shape[1]] = routed
            routings.append(ids)
    started = time.perf_counter()
    # counts JOINED - 1 layers deeper, so that a prediction `depth` ahead still joins JOINED layers
    transitions = Transitions.fit(routings, layers, collected.num_experts, depth + JOINED - 1,
                                  sources=JOINED)
    path = save_transitions(transitions, transitions_path(out), fingerprint=fingerprint)
    return {"out": str(path), "depth": depth, "layers_joined": transitions.sources,
            "fit_s": round(time.perf_counter() - started, 2)}


def fit_eviction_beside(collected: Collected, out: Path, seed: int) -> dict[str, Any]:
    """Fit the eviction policy to the traced requests' routing (`moeinf.policy.fitted`) and write it beside
    the EAMC, where `eviction='fitted'` finds it."""
    from ..policy.fitted import fit_eviction, fit_path

    fit = fit_eviction([trace.step_counts() for trace in collected.raw], top_k=collected.top_k, seed=seed)
    path = fit.save(fit_path(out))
    return {"out": str(path), "requests": fit.meta["requests"], "fit_s": fit.meta["fit_s"]}
