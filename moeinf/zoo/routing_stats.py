"""How realistic a model's routing is, measured on the unmodified HuggingFace model with RouterTracer.

Two views, after the MoE-Infinity paper's observations:

- load: per MoE layer, over the prompt tokens of held-out prompts, the busiest expert's token count over
  the mean count (1.0 = perfectly balanced). A badly balanced model would make any cache look good.
- per sequence (prompt + a sampled continuation): the share of a layer's experts the sequence activates
  and, of those, the share it reuses (activated by >= 2 tokens), averaged over layers. Each is set next
  to what balanced random top-k routing of the same number of tokens would give, so sparsity that
  comes only from short sequences is not mistaken for learned locality.

Run as `python -m moeinf.zoo.routing_stats MODEL_DIR [--json]`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..trace.router import RouterTracer, generated_lengths
from .corpus import Example, heldout_prompts
from .tokenizer import chat_text

log = logging.getLogger(__name__)


def random_routing_fractions(tokens: int, top_k: int, num_experts: int) -> tuple[float, float]:
    """Expected (activated, reused) fractions if each of `tokens` tokens picked `top_k` distinct experts
    uniformly at random: an expert is hit by each token with probability p = k/E, independently."""
    p = top_k / num_experts
    none = (1.0 - p) ** tokens
    once = tokens * p * (1.0 - p) ** (tokens - 1)
    activated = 1.0 - none
    reused = (activated - once) / activated if activated > 0 else 0.0
    return activated, reused


def load_imbalance(counts: np.ndarray) -> np.ndarray:
    """Per layer, max over mean of the expert token counts `[L, E]` -> `[L]`."""
    mean = counts.mean(axis=1)
    return np.where(mean > 0, counts.max(axis=1) / np.maximum(mean, 1e-12), np.nan)


def sequence_fractions(eam: np.ndarray) -> tuple[float, float]:
    """(activated, reused) fractions of one sequence's EAM `[L, E]`, averaged over layers."""
    activated = (eam >= 1).sum(axis=1)
    reused = (eam >= 2).sum(axis=1)
    act_frac = activated / eam.shape[1]
    reuse_frac = np.where(activated > 0, reused / np.maximum(activated, 1), 0.0)
    return float(act_frac.mean()), float(reuse_frac.mean())


def routing_stats(model_dir: str | Path, prompts: list[Example] | None = None, *, max_new_tokens: int = 64,
                  seed: int = 0, per_file: int = 10, temperature: float = 0.8) -> dict[str, Any]:
    """Routing figures of the checkpoint in `model_dir` on `prompts` (default: `per_file` held-out prompts
    of each held-out file), with sampled generation of `max_new_tokens` tokens per sequence."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if prompts is None:
        prompts = heldout_prompts(per_file, seed=seed)
    if not prompts:
        raise ValueError("routing_stats needs at least one prompt")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    torch.manual_seed(seed)

    with RouterTracer(model) as tracer:
        num_layers, num_experts, top_k = tracer.num_layers, tracer.num_experts, tracer.top_k
        prompt_counts = np.zeros((num_layers, num_experts), dtype=np.float64)
        per_sequence = []
        for example in prompts:
            ids = tokenizer(chat_text(example.prompt), add_special_tokens=False,
                            return_tensors="pt").input_ids  # [1, T]
            tracer.reset()
            with torch.no_grad():
                model(input_ids=ids)
            prompt_counts += tracer.eams()[0]
            tracer.reset()
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     temperature=temperature, max_new_tokens=max_new_tokens,
                                     min_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
            new = out[:, ids.shape[1]:]
            eam = tracer.eams(generated_lengths(new, None))[0]
            tokens = int(eam[0].sum()) // top_k
            activated, reused = sequence_fractions(eam)
            rand_activated, rand_reused = random_routing_fractions(tokens, top_k, num_experts)
            per_sequence.append((tokens, activated, reused, rand_activated, rand_reused))

    imbalance = load_imbalance(prompt_counts)
    seq = np.array(per_sequence)
    return {
        "model_dir": str(model_dir),
        "model_type": model.config.model_type,
        "num_layers": num_layers,
        "num_experts": num_experts,
        "top_k": top_k,
        "prompts": len(prompts),
        "prompt_tokens": int(prompt_counts[0].sum()) // top_k,
        "max_mean_load": [round(float(x), 3) for x in imbalance],
        "max_mean_load_worst": round(float(np.nanmax(imbalance)), 3),
        "new_tokens": max_new_tokens,
        "sequence_tokens_mean": round(float(seq[:, 0].mean()), 1),
        "activated_fraction": round(float(seq[:, 1].mean()), 4),
        "reused_fraction": round(float(seq[:, 2].mean()), 4),
        "random_activated_fraction": round(float(seq[:, 3].mean()), 4),
        "random_reused_fraction": round(float(seq[:, 4].mean()), 4),
    }


def _format(stats: dict[str, Any]) -> str:
    loads = " ".join(f"{x:.2f}" for x in stats["max_mean_load"])
    return (
        f"{stats['model_dir']} ({stats['model_type']}, {stats['num_layers']} MoE layers x "
        f"{stats['num_experts']} experts, top-{stats['top_k']})\n"
        f"max/mean expert load per layer over {stats['prompt_tokens']} prompt tokens of {stats['prompts']} "
        f"held-out prompts: {loads} (worst {stats['max_mean_load_worst']:.2f})\n"
        f"per sequence ({stats['sequence_tokens_mean']:.0f} tokens on average, "
        f"{stats['new_tokens']} sampled): "
        f"activated {100 * stats['activated_fraction']:.1f}% of experts "
        f"(balanced random routing: {100 * stats['random_activated_fraction']:.1f}%), "
        f"reused {100 * stats['reused_fraction']:.1f}% of those "
        f"(random: {100 * stats['random_reused_fraction']:.1f}%)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moeinf.zoo.routing_stats", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path, help="a save_pretrained checkpoint with its tokenizer")
    parser.add_argument("--per-file", type=int, default=10, help="held-out prompts drawn from each file")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="sampled tokens per sequence")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(2)
    stats = routing_stats(args.model_dir, max_new_tokens=args.max_new_tokens, seed=args.seed,
                          per_file=args.per_file)
    sys.stdout.write((json.dumps(stats) if args.json else _format(stats)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
