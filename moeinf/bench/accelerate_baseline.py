"""Accelerate baseline: per-token decode latency of HuggingFace + accelerate disk offload.

The model is loaded as a HuggingFace user would offload it: `from_pretrained(..., device_map=...,
offload_folder=...)`, every dense module in RAM ("cpu") and the expert modules of each MoE layer on
"disk", except as many layers' experts as fit in the same DRAM budget moeinf's cache gets (`--cache`,
a fraction of all expert bytes), which stay in RAM. Greedy decoding of real prompts; the per-token
latency is the time between consecutive decode steps (prefill excluded), as in `moeinf bench e2e`.

On CPU accelerate memory-maps the offloaded weights: while the page cache holds them, "disk" offload runs
at close to all-in-RAM speed and uses far more memory than the budget says. `--drop-caches` evicts the
offload files from the page cache (posix_fadvise DONTNEED) before every decode step, so the comparison
holds memory equal; the time spent evicting is excluded from the latencies. Free memory is reported
before and after.

`--routing zoo` replays the trained zoo model's routing through the gates, as `moeinf bench e2e` does by
default (see moeinf/bench/replay_routing.py), so both benchmarks decode the same prompts routed alike:
MODEL_DIR is then e2e's checkpoint with as many MoE layers as the zoo model.

  moeinf bench accelerate ~/.cache/moeinf/models/full-v1 --cache 0.25 --drop-caches --json
  moeinf bench accelerate $BENCH_DATA/e2e-qwen3-30b-geometry --routing zoo --cache 0.25 --drop-caches
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .replay_routing import Routing

MMAP_NOTE = ("on CPU accelerate memory-maps offloaded weights, so while the page cache holds them disk "
             "offload runs near all-in-RAM speed; use --drop-caches to hold memory equal")


def meminfo() -> dict[str, int]:
    """MemFree and MemAvailable from /proc/meminfo, in MiB."""
    values = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, rest = line.split(":", 1)
        if key in ("MemFree", "MemAvailable"):
            values[key] = int(rest.split()[0]) // 1024
    return {"free_mib": values["MemFree"], "available_mib": values["MemAvailable"]}


def drop_page_cache(paths: Sequence[Path]) -> float:
    """posix_fadvise(DONTNEED) on each file; returns the seconds it took."""
    start = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return time.perf_counter() - start


class DecodeClock:
    """A logits processor that timestamps decode steps and optionally evicts files from the page cache.

    The eviction runs after the timestamp, and its duration is subtracted from the next interval, so
    latencies measure the model only.
    """

    def __init__(self, drop_files: Sequence[Path]) -> None:
        self.drop_files = list(drop_files)
        self.stamps: list[float] = []
        self.drop_seconds: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        self.drop_seconds.append(drop_page_cache(self.drop_files) if self.drop_files else 0.0)
        return scores

    def token_latencies(self) -> list[float]:
        return [b - a - drop for a, b, drop in
                zip(self.stamps, self.stamps[1:], self.drop_seconds, strict=False)]


def expert_modules(model: torch.nn.Module) -> list[tuple[str, int]]:
    """(module name, bytes) of each MoE layer's routed experts, in layer order."""
    found = []
    for name, module in model.named_modules():
        if name.endswith(".mlp.experts"):
            found.append((name, sum(p.numel() * p.element_size() for p in module.parameters())))
    if not found:
        raise ValueError(f"{model.config.model_type}: no '.mlp.experts' modules found; the accelerate "
                         "baseline supports models whose routed experts live in <layer>.mlp.experts")
    return found


def add_dense_subtrees(module: torch.nn.Module, name: str, experts: set[str],
                       device_map: dict[str, str]) -> None:
    """Map to "cpu" the largest submodules of `module` that contain none of the `experts` modules."""
    if name in experts:
        return
    if not any(e == name or e.startswith(f"{name}.") or not name for e in experts):
        device_map[name] = "cpu"
        return
    if any(True for _ in module.named_parameters(recurse=False)):
        raise ValueError(f"{name!r} holds parameters next to expert modules; the accelerate baseline "
                         "cannot split it into a device_map")
    for child_name, child in module.named_children():
        add_dense_subtrees(child, f"{name}.{child_name}" if name else child_name, experts, device_map)


def plan_device_map(model_dir: Path, cache: float) -> tuple[dict[str, str], dict[str, Any]]:
    """device_map with experts on "disk" except the leading layers that fit `cache` x expert bytes."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    experts = expert_modules(skeleton)
    expert_bytes = sum(size for _, size in experts)
    total_bytes = sum(p.numel() * p.element_size() for p in skeleton.parameters())
    budget = int(cache * expert_bytes)
    device_map: dict[str, str] = {}
    in_ram = 0
    for name, size in experts:
        if in_ram + size <= budget:
            in_ram += size
            device_map[name] = "cpu"
        else:
            device_map[name] = "disk"
    # accelerate places every submodule of a "cpu" entry in RAM, disk entries below it included, so the
    # modules around the experts are listed as their largest subtrees that hold no expert module.
    add_dense_subtrees(skeleton, "", set(device_map), device_map)
    plan = {"expert_bytes": expert_bytes, "dense_bytes": total_bytes - expert_bytes,
            "expert_budget_bytes": budget, "experts_in_ram_bytes": in_ram,
            "expert_layers_on_disk": sum(1 for device in device_map.values() if device == "disk"),
            "expert_layers": len(experts),
            "max_memory_bytes": total_bytes - expert_bytes + budget}
    return device_map, plan


def accelerate_token_latency(model_dir: str | Path, prompts: Sequence[str], max_new_tokens: int, *,
                             cache: float = 0.25, drop_caches: bool = False, warmup: int = 1,
                             max_prompt_tokens: int = 64, offload_folder: str | Path | None = None,
                             routings: Sequence[Routing] | None = None) -> dict[str, Any]:
    """Per-token decode latency of `model_dir` under accelerate disk offload with a DRAM budget of the
    dense weights plus `cache` x the expert bytes. The first `warmup` prompts are decoded unmeasured.
    With `routings` (one per prompt, see moeinf/bench/replay_routing.py) the model's gates replay them and
    prompt i is the token ids its routing was recorded on; else the model's tokenizer encodes the prompts
    and its own router routes. Returns medians in seconds, all latencies, the device plan and free memory
    before and after."""
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    from moeinf.hf.tokenizer import load_tokenizer

    from .replay_routing import RoutingCursor, install_replay

    if not 0.0 <= cache <= 1.0:
        raise ValueError(f"cache={cache}: pass a fraction of the expert bytes in [0, 1]")
    if len(prompts) <= warmup:
        raise ValueError(f"{len(prompts)} prompts with warmup={warmup}: pass more prompts than warm-ups")
    if routings is not None and len(routings) != len(prompts):
        raise ValueError(f"{len(routings)} routings for {len(prompts)} prompts: pass one per prompt")
    model_dir = Path(model_dir)
    tokenizer, _ = load_tokenizer(model_dir)
    device_map, plan = plan_device_map(model_dir, cache)
    memory_before = meminfo()
    with tempfile.TemporaryDirectory(prefix="moeinf-accelerate-") as scratch:
        folder = Path(offload_folder) if offload_folder else Path(scratch)
        model = AutoModelForCausalLM.from_pretrained(model_dir, device_map=device_map,
                                                     offload_folder=str(folder)).eval()
        # accelerate reads disk-offloaded weights from its own .dat files or straight from the
        # checkpoint's safetensors: both are evicted.
        drop_files = sorted(p for p in [*folder.rglob("*"), *model_dir.glob("*.safetensors")] if p.is_file())
        cursor = RoutingCursor(routings) if routings is not None else None
        if cursor is not None:
            install_replay(model, cursor)
        latencies: list[float] = []
        with torch.inference_mode():
            for i, text in enumerate(prompts):
                if cursor is not None:
                    cursor.start(i)
                    ids = routings[i].prompt_ids(model.config.vocab_size)
                else:
                    ids = torch.tensor([tokenizer.encode(text)[:max_prompt_tokens]])
                clock = DecodeClock(drop_files if drop_caches else [])
                if drop_caches:
                    drop_page_cache(drop_files)
                model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                               do_sample=False, logits_processor=LogitsProcessorList([clock]))
                if i >= warmup:
                    latencies.extend(clock.token_latencies())
        memory_after = meminfo()
        del model
    return {"config": "accelerate-disk-offload", "model_dir": str(model_dir), "cache": cache,
            "drop_caches": drop_caches, "new_tokens": max_new_tokens, "prompts": len(prompts) - warmup,
            "median_s": statistics.median(latencies), "p90_s": float(torch.tensor(latencies).quantile(0.9)),
            "latencies": latencies, "plan": plan, "offload_files": len(drop_files),
            "memory_before": memory_before, "memory_after": memory_after, "note": MMAP_NOTE,
            "routing": "replayed" if routings is not None else "own",
            "torch_threads": torch.get_num_threads()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="HuggingFace checkpoint directory")
    parser.add_argument("--cache", type=float, default=0.25,
                        help="DRAM budget for experts, fraction of all expert bytes (0.25, as e2e's 25%%)")
    parser.add_argument("--prompts", type=int, default=4, help="measured prompts")
    parser.add_argument("--warmup", type=int, default=1, help="prompts decoded first, not measured")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=64)
    parser.add_argument("--routing", choices=("own", "zoo"), default="own",
                        help="own: the checkpoint's router; zoo: replay the zoo model's routing (a Qwen3-MoE "
                             "checkpoint with as many MoE layers as the zoo model, as `bench e2e` builds)")
    parser.add_argument("--zoo-variant", default="full", help="with --routing zoo: the zoo model replayed")
    parser.add_argument("--seed", type=int, default=0, help="with --routing zoo: the zoo's sampling seed")
    parser.add_argument("--drop-caches", action="store_true",
                        help="evict the offload files from the page cache before every decode step")
    parser.add_argument("--out", metavar="DIR", help="append the result to DIR/accelerate.jsonl")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def zoo_routings(args: argparse.Namespace, texts: Sequence[str]) -> tuple[list[Routing], str]:
    """The zoo model's routing of `texts`, mapped onto MODEL_DIR's experts, and its description."""
    from moeinf.zoo import get_model

    from .replay_routing import map_recordings, mapping_for, record_routing

    recordings = record_routing(get_model(args.zoo_variant), texts, new_tokens=args.new_tokens,
                                max_prompt_tokens=args.max_prompt_tokens, seed=args.seed)
    mapping = mapping_for(args.model_dir, recordings)
    return map_recordings(recordings, mapping), mapping.describe(args.zoo_variant)


def run(args: argparse.Namespace) -> int:
    from moeinf.bench.e2e import load_prompts

    from .replay_routing import ReplayError

    texts = load_prompts(args.warmup + args.prompts)
    routings, routing = None, args.routing
    try:
        if args.routing == "zoo":
            routings, routing = zoo_routings(args, texts)
        result = accelerate_token_latency(args.model_dir, texts, args.new_tokens, cache=args.cache,
                                          drop_caches=args.drop_caches, warmup=args.warmup,
                                          max_prompt_tokens=args.max_prompt_tokens, routings=routings)
    except (ValueError, ReplayError) as exc:
        print(f"moeinf bench accelerate: error: {exc}", file=sys.stderr)
        return 2
    result = {"bench": "accelerate", **result, "routing": routing}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with (out / "accelerate.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")
    if args.json:
        print(json.dumps(result))
        return 0
    plan = result["plan"]
    print(f"accelerate disk offload of {result['model_dir']}: {plan['expert_layers_on_disk']} of "
          f"{plan['expert_layers']} expert layers on disk, budget {plan['max_memory_bytes'] / 2**20:.1f} MiB")
    print(f"median per-token decode latency: {result['median_s'] * 1000:.1f} ms (p90 "
          f"{result['p90_s'] * 1000:.1f} ms), drop-caches={result['drop_caches']}")
    print(f"free memory before/after: {result['memory_before']['free_mib']}/"
          f"{result['memory_after']['free_mib']} MiB")
    print(f"note: {MMAP_NOTE}")
    return 0
