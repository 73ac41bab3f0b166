"""End-to-end decode latency: activation-aware offloading vs all-in-RAM HF vs on-demand LRU, in one run.

The model is a Qwen3-MoE with Qwen3-30B-A3B's expert geometry (hidden 2048, moe_intermediate 768, 128
experts, top-8, bf16) and enough layers for >= 8 GB of experts, random weights, built once (streamed, one
layer at a time) under --model-dir. Prompts are real (moeinf/data/prompts), tokenised with the model's
tokenizer (the byte fallback: the checkpoint ships none). Each configuration decodes --new-tokens greedy
tokens per prompt; the per-token latency is the time between consecutive decode steps (prefill excluded),
and the summary reports medians and their ratios. The store is read with O_DIRECT (the engine's default),
so the page cache does not flatter offloading.

  moeinf bench e2e --model-dir /work/bench-data/e2e-qwen3-30b-geometry --prompts 4 --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

GEOMETRY = dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
                num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                norm_topk_prob=True, vocab_size=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                max_position_embeddings=4096, decoder_sparse_step=1, mlp_only_layers=[])
PROMPT_FILES = ("mt_bench.jsonl", "gsm8k_test.jsonl", "mmlu_dev.jsonl", "self_instruct_seed.jsonl")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", default="/work/bench-data/e2e-qwen3-30b-geometry",
                        help="checkpoint directory; built there when missing")
    parser.add_argument("--layers", type=int, default=7, help="MoE layers when building (7: 8.5 GB)")
    parser.add_argument("--cache", default="25%", help="device_cache of the offloaded runs")
    parser.add_argument("--prompts", type=int, default=4, help="measured prompts per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="prompts run first (warm-up, EAMC seed)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true", help="skip the all-in-RAM HF baseline")
    parser.add_argument("--out", default=None, help="append JSON lines here (default: stdout only)")
    parser.add_argument("--seed", type=int, default=0)


def build_checkpoint(out: Path, layers: int, seed: int) -> None:
    """Write a random-weight Qwen3-MoE checkpoint layer by layer (bounded memory: one layer at a time)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_moe", num_hidden_layers=layers, dtype="bfloat16", **GEOMETRY)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shapes = {k: v.shape for k, v in skeleton.state_dict().items() if ".mlp.experts." not in k}
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    hidden, inter = GEOMETRY["hidden_size"], GEOMETRY["moe_intermediate_size"]
    experts = GEOMETRY["num_experts"]

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)

    for layer in range(layers):
        tensors: dict[str, torch.Tensor] = {}
        prefix = f"model.layers.{layer}.mlp.experts"
        for e in range(experts):
            tensors[f"{prefix}.{e}.gate_proj.weight"] = normal((inter, hidden), 0.02)
            tensors[f"{prefix}.{e}.up_proj.weight"] = normal((inter, hidden), 0.02)
            tensors[f"{prefix}.{e}.down_proj.weight"] = normal((hidden, inter), 0.02)
        name = f"experts-{layer:03d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    dense: dict[str, torch.Tensor] = {}
    for key, shape in shapes.items():
        if "norm" in key:
            dense[key] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            # A wide router spreads tokens over many experts, as a trained one does.
            dense[key] = normal(tuple(shape), 1.0 if key.endswith("mlp.gate.weight") else 0.02)
    save_file(dense, str(out / "dense.safetensors"), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(dense, "dense.safetensors"))
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.save_pretrained(out)


def load_prompts(count: int) -> list[str]:
    root = Path(__file__).resolve().parent.parent / "data" / "prompts"
    texts: list[str] = []
    for name in PROMPT_FILES:
        with open(root / name) as f:
            texts.extend(json.loads(line)["prompt"] for line in f if line.strip())
    # Interleave task families so every run sees several.
    per_file = len(texts) // len(PROMPT_FILES)
    return [texts[(i % len(PROMPT_FILES)) * per_file + i // len(PROMPT_FILES)] for i in range(count)]


class StepClock:
    """A logits processor that timestamps every decode step (it changes no score)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores

    def token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]


def decode_latencies(generate: Any, inputs: list[torch.Tensor], new_tokens: int) -> list[float]:
    from transformers import LogitsProcessorList

    latencies: list[float] = []
    for ids in inputs:
        clock = StepClock()
        generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                 logits_processor=LogitsProcessorList([clock]))
        latencies.extend(clock.token_latencies())
    return latencies


def run_offloaded(model_dir: Path, args: argparse.Namespace, name: str, inputs: list[torch.Tensor],
                  warm: list[torch.Tensor], **knobs: Any) -> dict[str, Any]:
    from moeinf import MoE, OffloadConfig

    config = OffloadConfig(device_cache=args.cache, **knobs)
    with MoE(model_dir, config) as moe:
        decode_latencies(moe.generate, warm, args.new_tokens)
        moe.reset_stats()
        latencies = decode_latencies(moe.generate, inputs, args.new_tokens)
        stats = moe.stats()
    return {"config": name, "knobs": {"device_cache": args.cache, **knobs}, "latencies": latencies,
            "median_s": statistics.median(latencies), "stats": stats}


def run_hf(model_dir: Path, args: argparse.Namespace, inputs: list[torch.Tensor],
           warm: list[torch.Tensor]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        decode_latencies(model.generate, warm[:1], args.new_tokens)
        latencies = decode_latencies(model.generate, inputs, args.new_tokens)
    del model
    return {"config": "hf-all-in-ram", "latencies": latencies, "median_s": statistics.median(latencies)}


def run(args: argparse.Namespace) -> int:
    from moeinf.hf.tokenizer import load_tokenizer

    torch.manual_seed(args.seed)
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        print(f"building the benchmark checkpoint in {model_dir} ({args.layers} layers)...", flush=True)
        build_checkpoint(model_dir, args.layers, args.seed)
    tokenizer, _ = load_tokenizer(model_dir)
    texts = load_prompts(args.warmup + args.prompts)
    encoded = [torch.tensor([tokenizer.encode(t)[: args.max_prompt_tokens]]) for t in texts]
    warm, inputs = encoded[: args.warmup], encoded[args.warmup:]
    results = [
        run_offloaded(model_dir, args, "activation-aware", inputs, warm),
        run_offloaded(model_dir, args, "on-demand-lru", inputs, warm, prefetch="none", eviction="lru"),
    ]
    if not args.skip_hf:
        results.append(run_hf(model_dir, args, inputs, warm))
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}
    base = {r["config"]: r["median_s"] for r in results}
    lines = []
    for r in results:
        r.update(machine=machine, new_tokens=args.new_tokens, prompts=args.prompts, model_dir=str(model_dir),
                 vs_lru=r["median_s"] / base["on-demand-lru"],
                 vs_hf=r["median_s"] / base["hf-all-in-ram"] if "hf-all-in-ram" in base else None)
        lines.append(json.dumps(r))
    for line in lines:
        print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    print("\nmedian per-token decode latency:")
    for r in results:
        ratios = f"x{r['vs_lru']:.2f} of LRU" + (f", x{r['vs_hf']:.2f} of HF" if r["vs_hf"] else "")
        print(f"  {r['config']:>18}: {r['median_s'] * 1000:8.1f} ms  ({ratios})")
    return 0
