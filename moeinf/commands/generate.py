"""Generate text from a prompt with the model's experts offloaded, streaming it, then print the stats and
the speed (prefill and decode tokens/s).

  moeinf generate demo --prompt "The capital of France is"
  moeinf generate path/to/model --prompt "..." --device-cache 25% --max-new-tokens 64 --stop "."
  moeinf generate org/name --prompt "..." --temperature 0.7 --top-k 40 --repetition-penalty 1.1 --json
  moeinf generate demo --prompt-file question.txt       # or: cat question.txt | moeinf generate demo

MODEL is a checkpoint directory, a zoo model (demo, full) or a HuggingFace id. The expert store is packed
on first use (with progress). Without --device-cache a quarter of the experts stay in memory, as the demo
does; the choice is printed.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

from moeinf.commands import options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_model_argument(parser)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="the text to continue ('-': read it from stdin; without --prompt or "
                                         "--prompt-file, a prompt piped on stdin is read)")
    source.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE (UTF-8)")
    options.add_generation_arguments(parser, temperature=0.0)
    options.add_offload_arguments(parser, no_offload=True)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (text, ids, stats) instead of streaming the text")


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt: --prompt, --prompt-file, or stdin (`--prompt -`, or piped without either); one trailing
    newline of a file or of stdin is dropped (what `echo` and editors add), the rest is kept as written."""
    if args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise options.UsageError(f"--prompt-file {args.prompt_file}: no such file") from None
        except (OSError, UnicodeDecodeError) as exc:
            reason = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else exc.strerror or str(exc)
            raise options.UsageError(f"--prompt-file {args.prompt_file}: cannot read it ({reason})") from None
        where = "--prompt-file"
    elif args.prompt == "-" or (args.prompt is None and not sys.stdin.isatty()):
        text, where = sys.stdin.read(), "the prompt on stdin"
    elif args.prompt is None:
        raise options.UsageError("give the prompt: --prompt TEXT, --prompt-file FILE, or pipe it on stdin")
    else:
        text, where = args.prompt, "--prompt"
    if where != "--prompt":
        text = text.removesuffix("\n").removesuffix("\r")
    if not text.strip():
        raise options.UsageError(f"{where} is empty; give some text")
    return text


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import StoppingCriteriaList

    from moeinf.api import MoE, measure
    from moeinf.commands.stream import StopAtText, TextStream
    from moeinf.hf.tokenizer import load_tokenizer

    args.prompt = read_prompt(args)
    tokenizer, _kind = load_tokenizer(args.model_dir)
    prompt_ids = tokenizer.encode(args.prompt, verbose=False)  # check_context says it when too long
    if not prompt_ids:
        raise options.UsageError("--prompt encodes to no tokens; give some text")
    options.check_context(args.model_dir, len(prompt_ids), args.max_new_tokens)
    ids = torch.tensor([prompt_ids], dtype=torch.long)  # [1, T]
    stream = TextStream(tokenizer, prompt_ids, out=io.StringIO() if args.json else sys.stdout, stop=args.stop)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, streamer=stream,
                  stopping_criteria=StoppingCriteriaList([StopAtText(stream)]), **options.hf_sampling(args))
    if args.no_offload:
        model = plain_model(args.model_dir, args.dtype)
        usage = measure(model)
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, **kwargs)
        elapsed = time.perf_counter() - start
        seq2seq = bool(getattr(model.config, "is_encoder_decoder", False))
        stats = dict(usage.as_dict(), seconds=elapsed)
    else:
        config = options.offload_config(args, args.model_dir)
        options.ensure_store(args.model_dir, config, progress=not args.json)
        torch.manual_seed(args.seed)
        with MoE(args.model_dir, config) as moe:
            start = time.perf_counter()
            out = moe.generate(ids, **kwargs)
            elapsed = time.perf_counter() - start
            seq2seq = moe.seq2seq
            stats = dict(moe.stats(), seconds=elapsed)
    # A seq2seq model's output starts with the decoder start token, a causal model's with the prompt.
    new = out[0, 1:] if seq2seq else out[0, ids.shape[1]:]
    if args.json:
        print(json.dumps({"prompt": args.prompt, "text": stream.answer, "ids": new.tolist(), "stats": stats}))
        return 0
    print()
    print(f"-- {options.speed_line(stats)}; {elapsed:.2f} s", file=sys.stderr)
    if not args.no_offload:
        print(f"-- {options.stats_line(stats)}", file=sys.stderr)
    return 0


def plain_model(model_dir: str, dtype: str) -> Any:
    """The unmodified transformers model (--no-offload), in --dtype."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from moeinf.hf.model import resolve_dtype

    config = AutoConfig.from_pretrained(model_dir)
    cls = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    with torch.device("cpu"):
        return cls.from_pretrained(model_dir, dtype=resolve_dtype(config, dtype)).eval()
