"""Generate on prompt sets with the unmodified HuggingFace model, record which experts every sequence
activates (prompt and generated tokens), and build an EAMC by K-Means (Eq. 1).

  moeinf trace MODEL_DIR --prompts moeinf/data/prompts/gsm8k_test.jsonl moeinf/data/prompts/mt_bench.jsonl \\
      --out traces/model.eamc --capacity 300 --max-new-tokens 64 --limit 200

Prompts are JSONL lines {"id", "task", "prompt"}. The tokenizer is MODEL_DIR's own, or a byte-level
fallback when the directory has none (see moeinf/hf/tokenizer.py); the command says which. A capacity
above the number of distinct traced sequences is clamped to that number, with a warning; the EAMC file
records the requested and the effective capacity.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="HuggingFace checkpoint directory")
    parser.add_argument("--prompts", nargs="+", required=True, metavar="FILE.jsonl",
                        help='prompt files, one {"id", "task", "prompt"} per line (see moeinf/data/prompts)')
    parser.add_argument("--out", required=True, metavar="FILE.eamc", help="EAMC file to write")
    parser.add_argument("--capacity", type=int, default=300, help="EAMC entries (K-Means k; default 300)")
    parser.add_argument("--max-new-tokens", type=int, default=32,
                        help="tokens generated per prompt (default 32)")
    parser.add_argument("--limit", type=int, default=None, metavar="K",
                        help="at most K prompts from each file")
    parser.add_argument("--batch-size", type=int, default=8, metavar="B", help="prompts per generate() call")
    parser.add_argument("--max-prompt-tokens", type=int, default=256,
                        help="keep at most this many leading tokens of each prompt (default 256)")
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--seed", type=int, default=0, help="seed of sampling and K-Means (default 0)")
    parser.add_argument("--raw-out", metavar="FILE.jsonl",
                        help="also write the raw routing (expert ids and gate weights per token) as JSONL")
    parser.add_argument("--json", action="store_true", help="print one JSON object with the results")


def run(args: argparse.Namespace) -> int:
    from ..hf.fingerprint import fingerprint
    from ..trace.collect import build_eamc, collect, read_prompts
    from ..trace.rawtrace import write_raw

    for name in ("capacity", "max_new_tokens", "batch_size", "max_prompt_tokens"):
        if getattr(args, name) < 1:
            print(f"moeinf trace: error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.limit is not None and args.limit < 1:
        print("moeinf trace: error: --limit must be >= 1", file=sys.stderr)
        return 2
    started = time.perf_counter()
    prompts = read_prompts(args.prompts, args.limit)
    collected = collect(args.model_dir, prompts, max_new_tokens=args.max_new_tokens,
                        batch_size=args.batch_size, max_prompt_tokens=args.max_prompt_tokens,
                        sample=args.sample, seed=args.seed, raw=args.raw_out is not None,
                        progress=not args.json)
    if not args.json:
        print("tokenizer: byte-level fallback (MODEL_DIR has no tokenizer files)"
              if collected.tokenizer == "byte-fallback" else "tokenizer: MODEL_DIR's own")
    meta = {"fingerprint": fingerprint(args.model_dir), "model": Path(args.model_dir).resolve().name,
            "max_new_tokens": args.max_new_tokens, "sample": args.sample}
    eamc = build_eamc(collected, args.capacity, seed=args.seed, meta=meta)
    out = eamc.save(args.out)
    if args.raw_out:
        write_raw(args.raw_out, collected.raw)
    result = {"num_sequences": len(prompts), "capacity": eamc.capacity, "capacity_requested": args.capacity,
              "layers": collected.num_layers, "experts": collected.num_experts, "top_k": collected.top_k,
              "tokens": collected.tokens, "out": str(out), "raw_out": args.raw_out,
              "tokenizer": collected.tokenizer, "fingerprint": meta["fingerprint"],
              "elapsed": round(time.perf_counter() - started, 3)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"traced {result['num_sequences']} sequences ({result['tokens']} tokens, "
              f"{result['layers']} MoE layers x {result['experts']} experts) in {result['elapsed']} s; "
              f"EAMC of {result['capacity']} entries -> {out}"
              + (f"; raw routing -> {args.raw_out}" if args.raw_out else ""))
    return 0
