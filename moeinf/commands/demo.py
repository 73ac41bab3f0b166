"""Offload the zoo MoE with a cache smaller than its experts, answer a few held-out prompts, and print the
expert-cache statistics (hits, misses, prefetches).

  moeinf demo                 # the demo zoo model that ships with moeinf (already trained)
  moeinf demo --variant full  # the benchmark model (also shipped): its open-ended answers drift off topic
  moeinf demo --quick         # a smaller model, trained here in about 5 minutes on first use (rough answers)
  moeinf demo --retrain       # train the demo model again into the cache (78 minutes), then answer
  moeinf demo --json          # one JSON object: answers and stats

The model is a DeepSeek-V3-architecture MoE trained on the shipped prompt sets (moeinf.zoo); the prompts
come from files it was never trained on. The EAMC built for it (traces/zoo-<variant>.eamc, a collection of
expert activation matrices: which experts each traced sequence used) predicts which experts to prefetch;
without a matching one the runtime learns online. Trained models and stores live in `$MOEINF_CACHE`
(default ~/.cache/moeinf).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from typing import Any

from moeinf.commands import options

NOTES = {
    "quick": "the quick model trains for 4 minutes, so expect rough answers; "
             "`moeinf demo` runs the demo model",
    "full": "the benchmark model learnt translations beside its questions: its open-ended answers drift off "
            "topic, often into German; `moeinf demo` runs the demo model",
    "tiny": "the tiny model is a test fixture trained for seconds: its answers are noise",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moeinf.zoo.train import RECIPES

    parser.add_argument("--quick", action="store_true",
                        help="use the quick variant (same as --variant quick)")
    parser.add_argument("--variant", choices=sorted(RECIPES), default=None,
                        help="zoo model to use (default: demo)")
    parser.add_argument("--retrain", action="store_true",
                        help="train the model again into $MOEINF_CACHE (with a progress bar) instead of "
                        "using the shipped or cached one")
    parser.add_argument("--prompts", type=options.positive_int, default=2,
                        help="held-out prompts drawn from each file the demo asks from (the demo model: "
                        "GSM8K test and MMLU test part 3)")
    # Greedy by default: a model of this size stays on topic far more often without sampling.
    options.add_generation_arguments(parser, temperature=0.0)
    parser.add_argument("--greedy", action="store_true",
                        help="greedy decoding (same as --temperature 0, the default)")
    options.add_offload_arguments(parser, device_cache="25%")
    parser.add_argument("--json", action="store_true", help="print one JSON object (answers and stats)")


def _variant(args: argparse.Namespace) -> str:
    if args.quick and args.variant not in (None, "quick"):
        raise options.UsageError(f"--quick and --variant {args.variant} disagree; give one of them")
    return "quick" if args.quick else (args.variant or "demo")


def _answer(moe: Any, tokenizer: Any, prompt: str, args: argparse.Namespace, stream: bool) -> dict[str, Any]:
    import torch
    from transformers import StoppingCriteriaList

    from moeinf.commands.stream import StopAtText, TextStream
    from moeinf.zoo.tokenizer import chat_text

    ids = tokenizer(chat_text(prompt), add_special_tokens=False, return_tensors="pt").input_ids  # [1, T]
    streamer = TextStream(tokenizer, ids[0].tolist(), out=sys.stdout if stream else io.StringIO(),
                          stop=args.stop)
    start = time.perf_counter()
    out = moe.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                       pad_token_id=tokenizer.pad_token_id, streamer=streamer,
                       stopping_criteria=StoppingCriteriaList([StopAtText(streamer)]),
                       **options.hf_sampling(args))
    seconds = time.perf_counter() - start
    new = out[0, ids.shape[1]:].tolist()
    return {"prompt": prompt, "text": streamer.answer, "ids": new,
            "prompt_tokens": ids.shape[1], "seconds": round(seconds, 3)}


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from moeinf.api import MoE
    from moeinf.hub import zoo_model
    from moeinf.zoo.corpus import demo_prompts
    from moeinf.zoo.train import RECIPES

    started = time.perf_counter()
    if args.greedy:
        args.temperature = 0.0
    variant = _variant(args)
    model_dir = options.model_arg(zoo_model(variant, retrain=args.retrain, progress=not args.json))
    config = options.offload_config(args, model_dir)
    options.ensure_store(model_dir, config, progress=not args.json)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    torch.manual_seed(args.seed)
    answers = []
    with MoE(model_dir, config) as moe:
        expert_bytes = moe.store.expert_bytes
        for example in demo_prompts(args.prompts, seed=args.seed, corpus=RECIPES[variant].corpus):
            if not args.json:
                print(f"\n\n### [{example.task}] {example.prompt}\n", flush=True)
            answers.append(dict(_answer(moe, tokenizer, example.prompt, args, stream=not args.json),
                                id=example.id, task=example.task))
        stats = moe.stats()
    seconds = time.perf_counter() - started
    report = {"variant": variant, "model_dir": str(model_dir), "device_cache": config.device_cache,
              "eamc": config.eamc, "expert_bytes": expert_bytes, "answers": answers, "stats": stats,
              "seconds": round(seconds, 1)}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"\n\n-- {variant} model {model_dir}, experts offloaded with device_cache={config.device_cache} of "
          f"{expert_bytes / 2**20:.1f} MiB of experts; EAMC {config.eamc or 'none (learning online)'}")
    print(f"-- {options.speed_line(stats)}")
    print(f"-- {options.stats_line(stats)}; {seconds:.0f} s in all")
    if variant in NOTES:
        print(f"-- note: {NOTES[variant]}")
    return 0
