"""Generate text from a prompt with the model's experts offloaded, streaming it, then print the stats.

  moeinf generate path/to/model --prompt "The capital of France is" --max-new-tokens 32 --device-cache 25%
  moeinf generate path/to/model --prompt "..." --eamc traces/model.eamc --temperature 0.7 --json

The expert store is packed on first use (with a progress bar). Without --device-cache the budget is
chosen from the memory available and printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from moeinf.commands import options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_model_argument(parser)
    parser.add_argument("--prompt", required=True, type=options.non_empty_text, help="the text to continue")
    options.add_generation_arguments(parser, max_new_tokens=32, temperature=0.0)
    options.add_offload_arguments(parser)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (text, ids, stats) instead of streaming the text")


def run(args: argparse.Namespace) -> int:
    import torch

    from moeinf.api import MoE
    from moeinf.commands.stream import TextStream
    from moeinf.hf.tokenizer import load_tokenizer

    tokenizer, _kind = load_tokenizer(args.model_dir)
    prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        raise options.UsageError("--prompt encodes to no tokens; give some text")
    options.check_context(args.model_dir, len(prompt_ids), args.max_new_tokens)
    config = options.offload_config(args, args.model_dir)
    options.ensure_store(args.model_dir, config, progress=not args.json and sys.stderr.isatty())
    ids = torch.tensor([prompt_ids], dtype=torch.long)  # [1, T]
    sampling = ({"do_sample": False} if args.temperature == 0 else
                {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p})
    torch.manual_seed(args.seed)
    streamer = None if args.json else TextStream(tokenizer, prompt_ids)
    with MoE(args.model_dir, config) as moe:
        start = time.perf_counter()
        out = moe.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                           streamer=streamer, **sampling)
        elapsed = time.perf_counter() - start
        # A seq2seq model's output starts with the decoder start token, a causal model's with the prompt.
        new = out[0, 1:] if moe.seq2seq else out[0, ids.shape[1]:]
        stats = dict(moe.stats(), seconds=elapsed)
    if args.json:
        text = tokenizer.decode(new.tolist(), skip_special_tokens=True)
        print(json.dumps({"prompt": args.prompt, "text": text, "ids": new.tolist(), "stats": stats}))
        return 0
    print()
    print(f"-- {options.stats_line(stats)}; {elapsed:.2f} s", file=sys.stderr)
    return 0
