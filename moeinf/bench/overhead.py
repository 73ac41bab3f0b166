"""The runtime's own cost: decode ms/token with every expert resident, against HF on the same model.

With `device_cache` 100% and every expert loaded, moeinf reads nothing: what it adds to HF's ms/token is
its bookkeeping (routing dispatch, EAM recording, prefetch planning, cache acquire) and the per-expert
compute loop. The model is a Qwen3-MoE built from its transformers config at a moderate size (random
weights, saved once with `save_pretrained` under --model-dir), decoded greedily from the same prompt by
the unmodified HF model and by moeinf in one process, in alternating rounds (which one goes first
alternates too), so both see the same machine load. Figures are medians of per-token decode latencies
(prefill excluded); `ratio` = moeinf median / HF median.

    moeinf bench overhead                      # Qwen3-MoE 8 layers x 32 experts top-8, hidden 1024, fp32
    moeinf bench overhead --dtype bfloat16 --rounds 9 --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ..hf.tiny import save_tiny
from ..store.fingerprint import fingerprint
from .common import machine, write_jsonl
from .e2e import StepClock

DEFAULT_MODEL_DIR = "/tmp/moeinf-bench-overhead"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", default=DEFAULT_MODEL_DIR,
                        help="where the Qwen3-MoE checkpoint is built (reused when its config matches; "
                             "default: %(default)s)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (default: %(default)s)")
    parser.add_argument("--experts", type=int, default=32, help="experts per layer (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=8, help="experts per token (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (default: %(default)s)")
    parser.add_argument("--moe-intermediate", type=int, default=384,
                        help="expert intermediate size (default: %(default)s)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights and compute (default: %(default)s; bfloat16 is emulated on CPUs "
                             "without AVX512-BF16, which hides overhead behind slow matmuls)")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="prompt length (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per round (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="measured rounds, HF and moeinf alternating (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--out", default=None, help="directory for overhead.jsonl (default: none)")


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    return dict(hidden_size=args.hidden, moe_intermediate_size=args.moe_intermediate,
                intermediate_size=3 * args.moe_intermediate, num_hidden_layers=args.layers,
                num_attention_heads=max(args.hidden // 128, 1),
                num_key_value_heads=max(args.hidden // 512, 1), head_dim=128, num_experts=args.experts,
                num_experts_per_tok=args.top_k, norm_topk_prob=True, vocab_size=4096)


def ensure_model(args: argparse.Namespace) -> Path:
    """The checkpoint under --model-dir, built from the Qwen3-MoE config unless it is already there."""
    model_dir = Path(args.model_dir)
    wanted = {"config": model_config(args), "dtype": args.dtype}
    stamp = model_dir / "moeinf-bench.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == wanted:
        return model_dir
    save_tiny("qwen3_moe", model_dir, dtype=args.dtype, **wanted["config"])
    stamp.write_text(json.dumps(wanted))
    return model_dir


def decode(generate: Any, ids: torch.Tensor, new_tokens: int) -> list[float]:
    """Per-token decode latencies (s) of one greedy generation of `new_tokens` tokens."""
    from transformers import LogitsProcessorList

    clock = StepClock()
    with torch.inference_mode():
        generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                 logits_processor=LogitsProcessorList([clock]))
    return clock.token_latencies()


def run(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM

    from .common import refuse_counts

    counts = ("layers", "experts", "top_k", "hidden", "moe_intermediate", "prompt_tokens", "new_tokens",
              "rounds")
    refuse_counts("overhead", args, positive=counts, non_negative=("threads",))
    if args.top_k > args.experts:
        raise SystemExit(f"moeinf bench overhead: error: --top-k {args.top_k} exceeds --experts "
                         f"{args.experts}")

    from ..api import MoE
    from ..config import OffloadConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model_dir = ensure_model(args)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    # keyed by the checkpoint's fingerprint: a rebuilt model (another dtype or size) gets its own store
    store_dir = model_dir.parent / f"{model_dir.name}-{fingerprint(model_dir)[:16]}.moeinf"
    config = OffloadConfig(device_cache="100%", offload_dir=str(store_dir))
    ids = torch.randint(3, 4096, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    runs: dict[str, list[float]] = {"hf": [], "moeinf": []}
    rounds: list[dict[str, float]] = []
    with MoE(model_dir, config) as moe:
        # Warm-up: every expert is read once and stays (100% cache), caches and allocators settle.
        for _ in range(2):
            decode(moe.generate, ids, args.new_tokens)
            decode(hf.generate, ids, args.new_tokens)
        moe.reset_stats()
        contenders = {"hf": hf.generate, "moeinf": moe.generate}
        for r in range(args.rounds):
            order = ["hf", "moeinf"] if r % 2 == 0 else ["moeinf", "hf"]
            medians = {}
            for name in order:
                latencies = decode(contenders[name], ids, args.new_tokens)
                runs[name].extend(latencies)
                medians[name] = statistics.median(latencies)
            rounds.append({"round": r, **{f"{k}_ms": v * 1e3 for k, v in medians.items()},
                           "ratio": medians["moeinf"] / medians["hf"]})
            print(f"round {r}: HF {medians['hf'] * 1e3:.2f} ms/token, moeinf {medians['moeinf'] * 1e3:.2f} "
                  f"ms/token, ratio {rounds[-1]['ratio']:.3f}", flush=True)
        stats = moe.stats()
    hf_ms, moe_ms = (statistics.median(runs[k]) * 1e3 for k in ("hf", "moeinf"))
    header = {"bench": "overhead", "machine": machine(), "torch": torch.__version__,
              "threads": torch.get_num_threads(),
              "config": {"model": "qwen3_moe", **model_config(args), "dtype": args.dtype,
                         "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                         "rounds": args.rounds, "offload": {"device_cache": "100%",
                                                            "prefetch": config.prefetch,
                                                            "eviction": config.eviction}}}
    summary = {"hf_ms_per_token": hf_ms, "moeinf_ms_per_token": moe_ms, "ratio": moe_ms / hf_ms,
               "ratio_of_round_medians": statistics.median(r["ratio"] for r in rounds),
               "reads_while_measured": stats["reads"], "misses_while_measured": stats["misses"],
               "seconds": round(time.perf_counter() - started, 1)}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_jsonl(out / "overhead.jsonl", [*rounds, summary], header)
    print(json.dumps({**header, **summary}))
    return 0
