"""End-to-end decode latency: activation-aware offloading vs all-in-RAM HF vs on-demand LRU, in one run.

The model is a Qwen3-MoE with Qwen3-30B-A3B's expert geometry (hidden 2048, moe_intermediate 768, 128
experts, top-8, bf16) and enough layers for >= 8 GB of experts, random weights, built once (streamed, one
layer at a time) under --model-dir. Prompts are real (moeinf/data/prompts). Each configuration decodes
--new-tokens greedy tokens per prompt; the per-token latency is the time between consecutive decode steps
(prefill excluded), and the summary reports medians and their ratios. Each offloaded configuration runs
at every --cache size, HF once. The store is read with O_DIRECT (the engine's default), so the page cache
does not flatter offloading.

Routing (--routing): a random router makes routing unpredictable and prefetching meaningless, so by
default (`zoo`) the gates of every model replay the routing of the trained zoo model
(moeinf/bench/replay_routing.py): the zoo model samples a continuation of each chat-formatted prompt,
its router scores are recorded and mapped onto the big model's experts (zoo expert e -> big experts
2e, 2e+1 for 64 -> 128), and the big model is fed the zoo's prompt ids (modulo its vocabulary). The
checkpoint then has as many MoE layers as the zoo model (8 for `full`: 9.7 GB of experts); a --model-dir
built with another count is kept, and the right one is built next to it (`<dir>-<L>layers`). The
activation-aware configuration gets an EAMC of the replayed routing of --eamc-prompts other prompts.
`random` keeps the checkpoint's own router and byte-level tokenisation. When --model-dir holds a model
that is not a Qwen3-MoE (such as the zoo model itself), the default is its own routing.

  moeinf bench e2e --model-dir /work/bench-data/e2e-qwen3-30b-geometry --prompts 4 --new-tokens 32 \\
      --cache 10%,25%,50%
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .replay_routing import RoutingCursor, install_replay

GEOMETRY = dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
                num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                norm_topk_prob=True, vocab_size=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                max_position_embeddings=4096, decoder_sparse_step=1, mlp_only_layers=[])
# For smoke runs of the benchmark's code path: the tiny zoo variant's 8 experts map onto 16.
TINY_GEOMETRY = dict(GEOMETRY, hidden_size=64, moe_intermediate_size=32, intermediate_size=96, num_experts=16,
                     num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     vocab_size=512)
GEOMETRIES = {"30b": GEOMETRY, "tiny": TINY_GEOMETRY}
DEFAULT_LAYERS = 7
PROMPT_FILES = ("mt_bench.jsonl", "gsm8k_test.jsonl", "mmlu_dev.jsonl", "self_instruct_seed.jsonl")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", default="/work/bench-data/e2e-qwen3-30b-geometry",
                        help="checkpoint directory; built there when missing")
    parser.add_argument("--layers", type=int, default=None,
                        help=f"MoE layers when building (default: the zoo model's with --routing zoo, "
                             f"else {DEFAULT_LAYERS}: 8.5 GB)")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="30b", help=argparse.SUPPRESS)
    parser.add_argument("--routing", choices=("zoo", "random"), default=None,
                        help="zoo: replay the trained zoo model's routing (default); random: the "
                             "checkpoint's own router")
    parser.add_argument("--zoo-variant", default="full", help="zoo model whose routing is replayed")
    parser.add_argument("--cache", default="25%",
                        help="device_cache of the offloaded runs; a comma-separated list runs each size")
    parser.add_argument("--prompts", type=int, default=4, help="measured prompts per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="prompts run first (warm-up, EAMC seed)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=64)
    parser.add_argument("--eamc-prompts", type=int, default=40,
                        help="with --routing zoo: other prompts whose replayed routing builds the EAMC")
    parser.add_argument("--eamc-new-tokens", type=int, default=16,
                        help="with --routing zoo: tokens generated per EAMC prompt")
    parser.add_argument("--skip-hf", action="store_true", help="skip the all-in-RAM HF baseline")
    parser.add_argument("--out", default=None, help="append JSON lines here (default: stdout only)")
    parser.add_argument("--seed", type=int, default=0)


def build_checkpoint(out: Path, layers: int, seed: int, geometry: dict[str, Any] = GEOMETRY) -> None:
    """Write a random-weight Qwen3-MoE checkpoint layer by layer (bounded memory: one layer at a time)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_moe", num_hidden_layers=layers, dtype="bfloat16", **geometry)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shapes = {k: v.shape for k, v in skeleton.state_dict().items() if ".mlp.experts." not in k}
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    hidden, inter = geometry["hidden_size"], geometry["moe_intermediate_size"]
    experts = geometry["num_experts"]

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


def decode_latencies(generate: Any, inputs: Sequence[torch.Tensor], new_tokens: int,
                     cursor: RoutingCursor | None = None, first: int = 0) -> list[float]:
    """Decode every input; with a routing cursor, input j replays the routing of prompt `first + j`."""
    from transformers import LogitsProcessorList

    latencies: list[float] = []
    for j, ids in enumerate(inputs):
        if cursor is not None:
            cursor.start(first + j)
        clock = StepClock()
        generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                 logits_processor=LogitsProcessorList([clock]))
        latencies.extend(clock.token_latencies())
    return latencies


@dataclass(frozen=True)
class Workload:
    """The prompts every configuration decodes, and the routing they replay (cursor None: own router)."""

    model_dir: Path
    warm: list[torch.Tensor]
    """[1, P] ids; with a cursor, warm-up prompt j replays cursor prompt j."""
    inputs: list[torch.Tensor]
    """[1, P] ids; measured prompt j replays cursor prompt len(warm) + j."""
    routing: str
    cursor: RoutingCursor | None = None
    eamc: str | None = None
    """EAMC of the replayed routing of other prompts, for activation-aware."""

    def install(self, model: torch.nn.Module) -> None:
        """Make `model` (an HF model, or `MoE.model`) route as the workload says."""
        if self.cursor is not None:
            install_replay(model, self.cursor)

    def warm_up(self, generate: Any, new_tokens: int, count: int | None = None) -> None:
        """Decode the first `count` (default all) warm-up prompts, unmeasured."""
        decode_latencies(generate, self.warm[:count], new_tokens, self.cursor, 0)

    def measure(self, generate: Any, new_tokens: int) -> list[float]:
        """Per-token decode latencies of the measured prompts."""
        return decode_latencies(generate, self.inputs, new_tokens, self.cursor, len(self.warm))


def run_offloaded(workload: Workload, cache: str, name: str, new_tokens: int, **knobs: Any) -> dict[str, Any]:
    from moeinf import MoE, OffloadConfig

    config = OffloadConfig(device_cache=cache, **knobs)
    with MoE(workload.model_dir, config) as moe:
        workload.install(moe.model)
        workload.warm_up(moe.generate, new_tokens)
        moe.reset_stats()
        latencies = workload.measure(moe.generate, new_tokens)
        stats = moe.stats()
    return {"config": name, "cache": cache, "knobs": {"device_cache": cache, **knobs}, "latencies": latencies,
            "median_s": statistics.median(latencies), "stats": stats}


def run_hf(workload: Workload, new_tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(workload.model_dir).eval()
    workload.install(model)
    with torch.inference_mode():
        workload.warm_up(model.generate, new_tokens, 1)
        latencies = workload.measure(model.generate, new_tokens)
    del model
    return {"config": "hf-all-in-ram", "cache": None, "latencies": latencies,
            "median_s": statistics.median(latencies)}


def layer_count(model_dir: Path) -> int:
    """MoE layers of a benchmark checkpoint (every decoder layer is one)."""
    return json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]


def model_type(model_dir: Path) -> str | None:
    """The model type of the checkpoint in `model_dir`, None when there is none yet."""
    config = model_dir / "config.json"
    return json.loads(config.read_text())["model_type"] if config.is_file() else None


def checkpoint_for(model_dir: Path, layers: int) -> Path:
    """`model_dir` if it holds (or will hold) a benchmark checkpoint of `layers` MoE layers; else its
    sibling `<model_dir>-<layers>layers`, so a checkpoint built with another count is kept."""
    if model_type(model_dir) is None or layer_count(model_dir) == layers:
        return model_dir
    sibling = model_dir.with_name(f"{model_dir.name}-{layers}layers")
    print(f"{model_dir} has {layer_count(model_dir)} MoE layers, the zoo model {layers}: using {sibling}",
          flush=True)
    if model_type(sibling) is not None and layer_count(sibling) != layers:
        raise ValueError(f"{sibling} has {layer_count(sibling)} MoE layers, not {layers}; delete it or pass "
                         f"--model-dir naming a directory to build a {layers}-layer checkpoint in")
    return sibling


def ensure_checkpoint(model_dir: Path, layers: int, args: argparse.Namespace) -> None:
    if not (model_dir / "config.json").is_file():
        print(f"building the benchmark checkpoint in {model_dir} ({layers} layers)...", flush=True)
        build_checkpoint(model_dir, layers, args.seed, GEOMETRIES[args.geometry])


def own_routing_workload(model_dir: Path, args: argparse.Namespace) -> Workload:
    """Prompts tokenised by the model's tokenizer (the byte fallback for a built checkpoint), own router."""
    from moeinf.hf.tokenizer import load_tokenizer

    ensure_checkpoint(model_dir, args.layers or DEFAULT_LAYERS, args)
    tokenizer, _ = load_tokenizer(model_dir)
    texts = load_prompts(args.warmup + args.prompts)
    encoded = [torch.tensor([tokenizer.encode(t)[: args.max_prompt_tokens]]) for t in texts]
    kind = model_type(model_dir)
    routing = "random" if kind == "qwen3_moe" else f"own ({kind} router)"
    return Workload(model_dir, encoded[: args.warmup], encoded[args.warmup:], routing)


def zoo_workload(model_dir: Path, args: argparse.Namespace, scratch: Path) -> Workload:
    """Record the zoo model on the warm-up, measured and EAMC prompts, build the checkpoint with its layer
    count, map the routing onto it and build the EAMC from the EAMC prompts' replayed routing."""
    from moeinf.zoo import get_model

    from .replay_routing import (
        ExpertMapping,
        build_replay_eamc,
        expert_shape,
        map_recordings,
        mapping_for,
        record_routing,
    )

    kind = model_type(model_dir)
    if kind not in (None, "qwen3_moe"):
        raise ValueError(f"{model_dir} is a {kind} model: --routing zoo replays into a benchmark Qwen3-MoE "
                         "checkpoint; pass --model-dir naming one (built when missing) or --routing random")
    zoo_dir = get_model(args.zoo_variant)
    geometry = GEOMETRIES[args.geometry]
    target = expert_shape(model_dir) if kind else (geometry["num_experts"], geometry["num_experts_per_tok"])
    ExpertMapping(expert_shape(zoo_dir)[0], *target)  # refuses shapes it cannot map before recording
    count = args.warmup + args.prompts
    texts = load_prompts(count + args.eamc_prompts)
    print(f"recording the routing of zoo model {args.zoo_variant!r} on {len(texts)} prompts...", flush=True)
    recorded = record_routing(zoo_dir, texts[:count], new_tokens=args.new_tokens,
                              max_prompt_tokens=args.max_prompt_tokens, seed=args.seed)
    for_eamc = record_routing(zoo_dir, texts[count:], new_tokens=args.eamc_new_tokens,
                              max_prompt_tokens=args.max_prompt_tokens, seed=args.seed + count)
    layers = recorded[0].selection.shape[1]
    if args.layers is not None and args.layers != layers:
        raise ValueError(f"--layers {args.layers}: replaying zoo model {args.zoo_variant!r} needs its "
                         f"{layers} MoE layers; drop --layers or use --routing random")
    model_dir = checkpoint_for(model_dir, layers)
    ensure_checkpoint(model_dir, layers, args)
    mapping = mapping_for(model_dir, recorded)
    routing = mapping.describe(args.zoo_variant)
    routings = map_recordings(recorded, mapping)
    eamc = build_replay_eamc(model_dir, map_recordings(for_eamc, mapping), scratch / "replay.eamc",
                             description=routing, seed=args.seed)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    encoded = [r.prompt_ids(vocab) for r in routings]
    return Workload(model_dir, encoded[: args.warmup], encoded[args.warmup:], routing,
                    RoutingCursor(routings), str(eamc))


def resolve_routing(args: argparse.Namespace, model_dir: Path) -> str:
    """--routing, else zoo unless --model-dir already holds another kind of model than the benchmark's."""
    if args.routing is not None:
        return args.routing
    kind = model_type(model_dir)
    if kind in (None, "qwen3_moe"):
        return "zoo"
    print(f"{model_dir} is a {kind} model, not a benchmark checkpoint: keeping its own routing", flush=True)
    return "random"


def run(args: argparse.Namespace) -> int:
    caches = [c.strip() for c in args.cache.split(",") if c.strip()]
    if not caches:
        print("moeinf bench e2e: error: --cache names no size", file=sys.stderr)
        return 2
    if args.eamc_prompts < 1:
        print("moeinf bench e2e: error: --eamc-prompts must be >= 1", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    model_dir = Path(args.model_dir)
    with tempfile.TemporaryDirectory(prefix="moeinf-e2e-") as scratch:
        try:
            if resolve_routing(args, model_dir) == "zoo":
                workload = zoo_workload(model_dir, args, Path(scratch))
            else:
                workload = own_routing_workload(model_dir, args)
        except ValueError as exc:
            print(f"moeinf bench e2e: error: {exc}", file=sys.stderr)
            return 2
        aware = {"eamc": workload.eamc} if workload.eamc else {}
        results = []
        for cache in caches:
            results.append(run_offloaded(workload, cache, "activation-aware", args.new_tokens, **aware))
            results.append(run_offloaded(workload, cache, "on-demand-lru", args.new_tokens, prefetch="none",
                                         eviction="lru"))
    if not args.skip_hf:
        results.append(run_hf(workload, args.new_tokens))
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}
    lru = {r["cache"]: r["median_s"] for r in results if r["config"] == "on-demand-lru"}
    hf = next((r["median_s"] for r in results if r["config"] == "hf-all-in-ram"), None)
    lines = []
    for r in results:
        r.update(machine=machine, new_tokens=args.new_tokens, prompts=args.prompts,
                 model_dir=str(workload.model_dir), routing=workload.routing,
                 vs_lru=r["median_s"] / lru[r["cache"]] if r["cache"] in lru else None,
                 vs_hf=r["median_s"] / hf if hf else None)
        lines.append(json.dumps(r))
    for line in lines:
        print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    print(f"\nmedian per-token decode latency (routing: {workload.routing}):")
    for r in results:
        ratios = [f"x{r[key]:.2f} of {name}" for key, name in (("vs_lru", "LRU"), ("vs_hf", "HF")) if r[key]]
        label = f"{r['config']} @ {r['cache']}" if r["cache"] else r["config"]
        print(f"  {label:>26}: {r['median_s'] * 1000:8.1f} ms  ({', '.join(ratios)})")
    return 0
