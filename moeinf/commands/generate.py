"""Generate text from a prompt with the model's experts offloaded, then print the runtime's stats.

  moeinf generate path/to/model --prompt "The capital of France is" --max-new-tokens 32 --cache 25%
  moeinf generate path/to/model --prompt "..." --eamc traces/model.eamc --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from moeinf.config import EVICTION_POLICIES, PREFETCH_POLICIES, ConfigError, OffloadConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="HuggingFace checkpoint directory")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--cache", default="25%",
                        help="expert budget of the compute tier (device_cache): bytes, '4GiB', '25%%', 0.25")
    parser.add_argument("--offload-dir", default=None, help="expert store (default MODEL_DIR.moeinf)")
    parser.add_argument("--eamc", default=None, help="EAMC file from `moeinf trace` (default: learn online)")
    parser.add_argument("--prefetch", default="activation-aware", choices=PREFETCH_POLICIES)
    parser.add_argument("--eviction", default="activation-aware", choices=EVICTION_POLICIES)
    parser.add_argument("--json", action="store_true", help="print one JSON object (text, ids, stats)")


def config_from_args(args: argparse.Namespace) -> OffloadConfig:
    return OffloadConfig(offload_dir=args.offload_dir, device_cache=args.cache, eamc=args.eamc,
                         prefetch=args.prefetch, eviction=args.eviction)


def run(args: argparse.Namespace) -> int:
    import torch

    from moeinf.api import MoE

    if args.max_new_tokens < 1:
        print("error: --max-new-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
        moe = MoE(args.model_dir, config)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with moe:
        tokenizer = moe.tokenizer
        ids = torch.tensor([tokenizer.encode(args.prompt)], dtype=torch.long)
        start = time.perf_counter()
        out = moe.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        elapsed = time.perf_counter() - start
        # A seq2seq model's output starts with the decoder start token, a causal model's with the prompt.
        new = out[0, 1:] if moe.seq2seq else out[0, ids.shape[1]:]
        text = tokenizer.decode(new.tolist(), skip_special_tokens=True)
        stats = dict(moe.stats(), seconds=elapsed)
    if args.json:
        print(json.dumps({"prompt": args.prompt, "text": text, "ids": new.tolist(), "stats": stats}))
        return 0
    print(text)
    print(f"\n-- {stats['tokens']} tokens in {elapsed:.2f} s; "
          f"hits {stats['hits']}, misses {stats['misses']}, "
          f"prefetch recall {stats['prefetch_recall']:.2f}, precision {stats['prefetch_precision']:.2f}, "
          f"read {stats['bytes_read'] / 2**20:.1f} MiB, stalled {stats['stall_s']:.2f} s", file=sys.stderr)
    return 0
