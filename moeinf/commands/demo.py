"""Train (or reuse) the small zoo MoE, offload its experts with a cache smaller than them, and answer a few
held-out prompts, then print the expert-cache statistics.

  moeinf demo                 # the full zoo model (trained once, about 30 minutes on a CPU, then cached)
  moeinf demo --quick         # a smaller model trained in a few minutes
  moeinf demo --json          # one JSON object: answers and stats

The model is a DeepSeek-V3-architecture MoE trained locally (moeinf.zoo) on the shipped prompt sets; the
prompts come from files it was never trained on. Its cache is `$MOEINF_CACHE` (default ~/.cache/moeinf).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from moeinf.config import ConfigError, OffloadConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moeinf.zoo.train import RECIPES

    parser.add_argument("--quick", action="store_true",
                        help="use the quick variant (same as --variant quick)")
    parser.add_argument("--variant", choices=sorted(RECIPES), default=None,
                        help="zoo model to use (default full)")
    parser.add_argument("--prompts", type=int, default=1,
                        help="held-out prompts drawn from each held-out file")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--cache", default="25%",
                        help="expert budget of the compute tier (device_cache): bytes, '4GiB', '25%%', 0.25")
    parser.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt draw and of sampling")
    parser.add_argument("--json", action="store_true", help="print one JSON object (answers and stats)")


def _variant(args: argparse.Namespace) -> str:
    if args.quick and args.variant not in (None, "quick"):
        raise ConfigError(f"--quick and --variant {args.variant} disagree; give one of them")
    return "quick" if args.quick else (args.variant or "full")


def _answer(moe: Any, tokenizer: Any, prompt: str, args: argparse.Namespace, stream: bool) -> dict[str, Any]:
    import torch
    from transformers import TextStreamer

    from moeinf.zoo.tokenizer import chat_text

    ids = tokenizer(chat_text(prompt), add_special_tokens=False, return_tensors="pt").input_ids  # [1, T]
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    sampling = {"do_sample": False} if args.greedy else {"do_sample": True, "temperature": 0.8, "top_p": 0.95}
    start = time.perf_counter()
    out = moe.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                       pad_token_id=tokenizer.pad_token_id, streamer=streamer, **sampling)
    seconds = time.perf_counter() - start
    new = out[0, ids.shape[1]:].tolist()
    return {"prompt": prompt, "text": tokenizer.decode(new, skip_special_tokens=True), "ids": new,
            "prompt_tokens": ids.shape[1], "seconds": round(seconds, 3)}


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from moeinf.api import MoE
    from moeinf.zoo import get_model
    from moeinf.zoo.corpus import heldout_prompts

    if args.max_new_tokens < 1 or args.prompts < 1:
        print("error: --max-new-tokens and --prompts must be >= 1", file=sys.stderr)
        return 2
    try:
        variant = _variant(args)
        model_dir = get_model(variant, progress=not args.json)
        moe = MoE(model_dir, OffloadConfig(device_cache=args.cache))
    except (ConfigError, ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    torch.manual_seed(args.seed)
    answers = []
    with moe:
        expert_bytes = moe.store.expert_bytes
        for example in heldout_prompts(args.prompts, seed=args.seed):
            if not args.json:
                print(f"\n### [{example.task}] {example.prompt}\n")
            answers.append(dict(_answer(moe, tokenizer, example.prompt, args, stream=not args.json),
                                id=example.id, task=example.task))
        stats = moe.stats()
    report = {"variant": variant, "model_dir": str(model_dir), "cache": args.cache,
              "expert_bytes": expert_bytes, "answers": answers, "stats": stats}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"\n-- {variant} model {model_dir}, experts offloaded with device_cache={args.cache} of "
          f"{expert_bytes / 2**20:.1f} MiB of experts")
    print(f"-- {stats['tokens']} tokens; expert accesses {stats['accesses']}, hits {stats['hits']}, "
          f"misses {stats['misses']} (hit rate {stats['hit_rate']:.2f}), evictions {stats['evictions']}, "
          f"prefetches {stats['prefetches']} (precision {stats['prefetch_precision']:.2f}, "
          f"recall {stats['prefetch_recall']:.2f}), read {stats['bytes_read'] / 2**20:.1f} MiB, "
          f"stalled {stats['stall_s']:.2f} s")
    return 0
