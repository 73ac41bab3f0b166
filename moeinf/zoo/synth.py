"""Synthesise a published MoE architecture at full size with random weights, as a normal HF checkpoint.

  moeinf zoo synth deepseek-v2-lite DIR

writes DIR/config.json (the published configuration), safetensors shards, model.safetensors.index.json and a
tokenizer (the shipped zoo model's byte-level BPE; its 8192 ids fit every vocabulary here), with the tensor
names of the published checkpoint (routed experts one by one: `mlp.experts.{e}.gate_proj.weight` ...).

Memory stays bounded whatever the model size: the model is built on the meta device (names and shapes
only), and each shard is written tensor by tensor (a safetensors header first, then each tensor generated
and appended), so the largest single tensor (the embedding: 419 MB for DeepSeek-V2-Lite) is all that is held.

Weights: every matrix N(0, initializer_range^2) (0.02: the published init), norms 1, biases 0; an RMSNorm
before every block keeps activations at unit scale, so the random model's logits and routing are sane (its
routing is near uniform: the worst case for any expert cache). Each tensor has its own generator seeded
from (seed, tensor name), so a shard's bytes do not depend on which shards were written before it.

Restartable: the plan (config, seed, shards and their tensors) is written first to `moeinf-synth.json`; each
shard is written under a temporary name, fsynced and renamed. A rerun with the same plan keeps the shards
that are complete (right name and size) and writes the rest; a different plan in a non-empty DIR is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import struct
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..disk import shortfall

MANIFEST = "moeinf-synth.json"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TOKENIZER_SOURCE = Path(__file__).parent / "weights" / "full"
DEFAULT_SHARD_BYTES = 2 << 30
DTYPES = {"bfloat16": (torch.bfloat16, "BF16"), "float16": (torch.float16, "F16"),
          "float32": (torch.float32, "F32")}
SMALL_FILES_BYTES = 8 << 20
"""Room for what synth writes besides the shards (config, index, tokenizer files): a few MB at most."""
# The zoo tokenizer's special ids (tokenizer_config.json of the shipped zoo model).
_SPECIAL_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


@dataclass(frozen=True)
class Architecture:
    """A published MoE configuration and how its checkpoint names the routed experts' tensors."""

    config: dict[str, Any]
    expert_prefix: str = "mlp.experts"
    """Checkpoint module path of a layer's routed experts (Mixtral: `block_sparse_moe.experts`)."""
    expert_tensors: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """Checkpoint names of one expert's gate, up and down projections (Mixtral: w1, w3, w2)."""
    source: str = ""


ARCHITECTURES: dict[str, Architecture] = {
    "deepseek-v2-lite": Architecture(
        {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
         "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
         "num_hidden_layers": 27, "first_k_dense_replace": 1, "moe_layer_freq": 1,
         "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
         "n_shared_experts": 2, "num_experts_per_tok": 6, "topk_method": "greedy", "n_group": 1,
         "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
         "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
         "v_head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 163840,
         "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False, "attention_dropout": 0.0,
         "initializer_range": 0.02, "tie_word_embeddings": False, "use_cache": True},
        source="deepseek-ai/DeepSeek-V2-Lite config.json (rope kept default: YaRN only rescales positions)"),
    "qwen3-30b-a3b": Architecture(
        {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
         "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
         "num_hidden_layers": 48, "decoder_sparse_step": 1, "mlp_only_layers": [],
         "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
         "num_experts_per_tok": 8, "norm_topk_prob": True, "hidden_act": "silu",
         "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
         "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
         "tie_word_embeddings": False, "use_cache": True},
        source="Qwen/Qwen3-30B-A3B config.json"),
    "mixtral-8x7b": Architecture(
        {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
         "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
         "num_experts_per_tok": 2, "hidden_act": "silu", "max_position_embeddings": 32768,
         "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None, "attention_dropout": 0.0,
         "initializer_range": 0.02, "tie_word_embeddings": False, "use_cache": True},
        expert_prefix="block_sparse_moe.experts", expert_tensors=("w1", "w3", "w2"),
        source="mistralai/Mixtral-8x7B-v0.1 config.json"),
    "olmoe-1b-7b": Architecture(
        {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": 50304,
         "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
         "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
         "norm_topk_prob": False, "hidden_act": "silu", "max_position_embeddings": 4096,
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "clip_qkv": None, "attention_bias": False,
         "attention_dropout": 0.0, "initializer_range": 0.02, "tie_word_embeddings": False,
         "use_cache": True},
        source="allenai/OLMoE-1B-7B-0924 config.json"),
}


class SynthError(ValueError):
    """A synth request that cannot be done as asked (unknown name, DIR holding something else)."""


@dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor of the plan: its name, shape and how it is initialised."""

    name: str
    shape: tuple[int, ...]
    init: str  # "normal", "ones" or "zeros"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Plan:
    """What DIR will hold: the config, and per shard file the tensors in it."""

    name: str
    config: dict[str, Any]
    dtype: str
    seed: int
    shards: dict[str, list[Tensor]] = field(default_factory=dict)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=DTYPES[self.dtype][0]).element_size()

    def shard_bytes(self, file: str) -> int:
        """The size of shard `file` on disk (header included)."""
        header = _header(self.shards[file], DTYPES[self.dtype][1], self.element_size)
        return 8 + len(header) + sum(t.numel for t in self.shards[file]) * self.element_size

    @property
    def total_bytes(self) -> int:
        return sum(t.numel for ts in self.shards.values() for t in ts) * self.element_size

    def to_json(self) -> dict[str, Any]:
        return {"format": "moeinf-synth", "version": 1, "name": self.name, "dtype": self.dtype,
                "seed": self.seed, "config": self.config,
                "shards": {f: [[t.name, list(t.shape), t.init] for t in ts] for f, ts in self.shards.items()}}


def architecture_config(name: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The published config of `name`, with `overrides` (tests shrink the sizes) and the zoo tokenizer's
    special ids."""
    if name not in ARCHITECTURES:
        raise SynthError(f"unknown architecture {name!r}; known: {', '.join(ARCHITECTURES)}")
    config = {**ARCHITECTURES[name].config, **(overrides or {}), **_SPECIAL_IDS}
    return config


def _init_of(name: str) -> str:
    if re.search(r"(norm|layernorm)\.weight$", name):
        return "ones"
    if name.endswith(".bias") or name.endswith("e_score_correction_bias"):
        return "zeros"
    return "normal"


def checkpoint_tensors(name: str, config: dict[str, Any]) -> list[Tensor]:
    """Every tensor of the published checkpoint layout, in the meta model's order, routed experts split
    into per-expert gate/up/down tensors (the runtime's fused [E, 2I, H] and [E, H, I] are not what
    published checkpoints hold)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = ARCHITECTURES[name]
    hf_config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    tensors: list[Tensor] = []
    fused = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
    gate, up, down = arch.expert_tensors
    for key, value in model.state_dict().items():
        match = fused.match(key)
        if match is None:
            if re.search(r"\.mlp\.experts\.\d+\.", key):
                raise SynthError(f"{key}: unexpected per-expert runtime tensor; synth expects fused experts")
            tensors.append(Tensor(key, tuple(value.shape), _init_of(key)))
            continue
        layer, kind = match.groups()
        experts = value.shape[0]
        prefix = f"{layer}.{arch.expert_prefix}"
        if kind == "gate_up_proj":
            if value.shape[1] % 2:
                raise SynthError(f"{key}: gate_up_proj of shape {tuple(value.shape)} is not [E, 2I, H]")
            half = (value.shape[1] // 2, value.shape[2])
            for e in range(experts):
                tensors.append(Tensor(f"{prefix}.{e}.{gate}.weight", half, "normal"))
                tensors.append(Tensor(f"{prefix}.{e}.{up}.weight", half, "normal"))
        else:
            for e in range(experts):
                tensors.append(Tensor(f"{prefix}.{e}.{down}.weight", tuple(value.shape[1:]), "normal"))
    # Published checkpoints list an expert's tensors together: gate, up, down of expert 0, then expert 1...
    return _experts_together(tensors, arch)


def _experts_together(tensors: list[Tensor], arch: Architecture) -> list[Tensor]:
    order = {t: i for i, t in enumerate(arch.expert_tensors)}
    pattern = re.compile(rf"^(model\.layers\.\d+\.{re.escape(arch.expert_prefix)})\.(\d+)\.(\w+)\.weight$")

    def key(item: tuple[int, Tensor]) -> tuple:
        position, tensor = item
        match = pattern.match(tensor.name)
        if match is None:
            return (position, 0, 0)
        # Keep the experts' block where its first tensor was; inside it, by expert then tensor kind.
        return (first[match.group(1)], int(match.group(2)), order[match.group(3)])

    first: dict[str, int] = {}
    for position, tensor in enumerate(tensors):
        match = pattern.match(tensor.name)
        if match is not None:
            first.setdefault(match.group(1), position)
    return [t for _, t in sorted(enumerate(tensors), key=key)]


def make_plan(name: str, *, dtype: str = "bfloat16", seed: int = 0, shard_bytes: int = DEFAULT_SHARD_BYTES,
              overrides: dict[str, Any] | None = None) -> Plan:
    """Shards of at most `shard_bytes` (a larger single tensor gets a shard of its own)."""
    if dtype not in DTYPES:
        raise SynthError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    config = architecture_config(name, overrides)
    plan = Plan(name, config, dtype, seed)
    size = plan.element_size
    groups: list[list[Tensor]] = [[]]
    used = 0
    for tensor in checkpoint_tensors(name, config):
        nbytes = tensor.numel * size
        if groups[-1] and used + nbytes > shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(tensor)
        used += nbytes
    count = len(groups)
    plan.shards = {f"model-{i + 1:05d}-of-{count:05d}.safetensors": g for i, g in enumerate(groups)}
    return plan


def _header(tensors: list[Tensor], code: str, element_size: int) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        end = offset + t.numel * element_size
        header[t.name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned


def tensor_values(tensor: Tensor, plan: Plan) -> torch.Tensor:
    """The values of `tensor`: deterministic in (seed, name) only."""
    dtype = DTYPES[plan.dtype][0]
    if tensor.init == "ones":
        return torch.ones(tensor.shape, dtype=dtype)
    if tensor.init == "zeros":
        return torch.zeros(tensor.shape, dtype=dtype)
    digest = hashlib.sha256(f"{plan.seed}:{tensor.name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    std = float(plan.config.get("initializer_range", 0.02))
    out = torch.empty(tensor.shape, dtype=dtype)
    return out.normal_(0.0, std, generator=generator)


class Progress:
    """A tqdm bar on a terminal; elsewhere one line every `every` seconds (and at the end)."""

    def __init__(self, total: int, desc: str, *, every: float = 10.0,
                 write: Callable[[str], None] | None = None) -> None:
        self.total, self.desc, self.every = total, desc, every
        self.done = 0
        self.start = self.last = time.monotonic()
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self.bar = None
        if write is None and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc)

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
            return
        now = time.monotonic()
        if now - self.last >= self.every or self.done >= self.total:
            self.last = now
            elapsed = now - self.start
            rate = self.done / elapsed if elapsed > 0 else 0.0
            eta = (self.total - self.done) / rate if rate > 0 else float("nan")
            self.write(f"{self.desc}: {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB "
                       f"({100 * self.done / max(self.total, 1):.0f}%), {elapsed:.0f} s, "
                       f"{rate / 1e6:.0f} MB/s, ETA {eta:.0f} s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _write_shard(path: Path, tensors: list[Tensor], plan: Plan, progress: Progress) -> None:
    code = DTYPES[plan.dtype][1]
    header = _header(tensors, code, plan.element_size)
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "wb") as out:
        out.write(struct.pack("<Q", len(header)))
        out.write(header)
        for tensor in tensors:
            values = tensor_values(tensor, plan)
            out.write(values.reshape(-1).view(torch.uint8).numpy())
            progress.update(values.nbytes)
            del values
        out.flush()
        os.fsync(out.fileno())
    os.rename(partial, path)
    drop_file_cache(path)


def drop_file_cache(path: Path) -> None:
    """Tell the kernel the file's clean pages are not needed soon (a written shard's would crowd out others'
    pages); a file that cannot be opened is left alone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass
    finally:
        os.close(fd)


def _shards_done(out: Path, plan: Plan) -> Iterator[str]:
    for file in plan.shards:
        path = out / file
        if path.is_file() and path.stat().st_size == plan.shard_bytes(file):
            yield file


def synth(name: str, out: str | Path, *, dtype: str = "bfloat16", seed: int = 0,
          shard_bytes: int = DEFAULT_SHARD_BYTES, overrides: dict[str, Any] | None = None,
          progress: Callable[[str], None] | None = None) -> Path:
    """Write (or finish writing) the random-weight checkpoint of architecture `name` in `out`."""
    out = Path(out)
    plan = make_plan(name, dtype=dtype, seed=seed, shard_bytes=shard_bytes, overrides=overrides)
    manifest = out / MANIFEST
    if out.exists() and not out.is_dir():
        raise SynthError(f"{out} exists and is not a directory")
    if manifest.is_file():
        held = json.loads(manifest.read_text())
        if held != json.loads(json.dumps(plan.to_json())):
            raise SynthError(f"{out} holds a synthesised checkpoint of another plan ({held.get('name')}, "
                             f"seed {held.get('seed')}, {held.get('dtype')}); remove it or name another DIR")
    elif out.exists() and any(out.iterdir()):
        raise SynthError(f"{out} exists and is not empty; remove it or name another directory")
    done = set(_shards_done(out, plan)) if out.is_dir() else set()
    todo = [f for f in plan.shards if f not in done]
    # the shards still to write, and a stale partial shard's bytes count as free: it is removed first
    stale = list(out.glob(".*.partial")) if out.is_dir() else []
    need = sum(plan.shard_bytes(f) for f in todo) - sum(p.stat().st_size for p in stale)
    short = shortfall(out, need + SMALL_FILES_BYTES, f"the rest of {name}" if done else name)
    if short:
        raise SynthError(f"{short}; free space or name a DIR on another disk")
    out.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps(plan.to_json()) + "\n")
    for path in stale:
        path.unlink()
    element = plan.element_size
    bar = Progress(sum(t.numel for f in todo for t in plan.shards[f]) * element, f"synth {name}",
                   write=progress)
    if done:
        bar.write(f"synth {name}: {len(done)} of {len(plan.shards)} shards already complete; writing the "
                  "rest")
    try:
        for file in todo:
            _write_shard(out / file, plan.shards[file], plan, bar)
    finally:
        bar.close()
    weight_map = {t.name: f for f, ts in plan.shards.items() for t in ts}
    index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    config = {**plan.config, "dtype": dtype}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "pad_token_id": config["pad_token_id"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for file in TOKENIZER_FILES:
        if (TOKENIZER_SOURCE / file).is_file():
            shutil.copyfile(TOKENIZER_SOURCE / file, out / file)
    return out
