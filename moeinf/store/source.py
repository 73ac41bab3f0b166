"""A HuggingFace checkpoint seen as the store will hold it: experts by (layer, expert), dense tensors
under their runtime keys, each as byte ranges of the source shards (nothing is read here).

The runtime model says what must exist: its skeleton, built on the meta device from config.json,
gives the experts modules (their order in `named_modules()` is the MoE-layer ordinal), the number of
experts and the runtime shape of each per-expert tensor. The spec table (`moeinf/spec.py`) says
how the checkpoint names them. Every per-expert runtime tensor is a concatenation of contiguous byte
ranges of the checkpoint: whole per-expert tensors stacked along dim 0 (gate rows then up rows), or
row e of a fused [E, ...] tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..spec import ArchSpec, ExpertTensor, spec_for
from .safetensors_file import TensorInfo, checkpoint_tensors

Piece = tuple[TensorInfo, int, int]
"""Bytes [start, end) of one checkpoint tensor."""


@dataclass(frozen=True)
class SourceTensor:
    """One per-expert runtime tensor: the checkpoint byte ranges it is the concatenation of."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(end - start for _, start, end in self.pieces)


@dataclass(frozen=True)
class Checkpoint:
    """A checked plan of a checkpoint: `experts[layer][expert]` and `dense` (runtime key, bytes)."""

    src_dir: Path
    config: Any
    spec: ArchSpec
    modules: list[str]
    num_experts: int
    experts: list[list[list[SourceTensor]]]
    dense: list[tuple[str, TensorInfo]]

    @classmethod
    def open(cls, src_dir: str | Path) -> Checkpoint:
        from transformers import AutoConfig

        src_dir = Path(src_dir)
        if not (src_dir / "config.json").is_file():
            raise FileNotFoundError(f"{src_dir} has no config.json; pass a HuggingFace model directory")
        config = AutoConfig.from_pretrained(src_dir)
        spec = spec_for(config.model_type)
        if getattr(config, "quantization_config", None):
            method = dict(config.quantization_config).get("quant_method", "?")
            raise ValueError(f"{src_dir} is a quantized checkpoint ({method}); moeinf packs unquantized "
                             "weights: save a dequantized copy with transformers first")
        skeleton = build_skeleton(config, spec)
        modules = {name: module for name, module in skeleton.named_modules()
                   if re.fullmatch(spec.experts_module, name)}
        if not modules:
            raise ValueError(f"the {config.model_type} model built from {src_dir}/config.json has no module "
                             f"matching {spec.experts_module!r}; fix `experts_module` in moeinf/spec.py")
        num_experts = spec.num_experts(config)
        tensors = _runtime_keys(checkpoint_tensors(src_dir), spec)
        consumed: set[str] = set()
        experts = []
        for name, module in modules.items():
            shapes = runtime_expert_shapes(spec, module, num_experts)
            experts.append([[_expert_tensor(spec, name, e, t, shapes[t.name], num_experts, tensors, consumed)
                             for t in spec.tensors if t.name in shapes] for e in range(num_experts)])
            stray = sorted(k for k in tensors if k.startswith(name + ".") and k not in consumed)
            if stray:
                raise ValueError(
                    f"{src_dir}: checkpoint tensor {stray[0]!r} is under the experts module {name} but "
                    "moeinf/spec.py does not describe it (a quantized checkpoint? moeinf stores "
                    "unquantized weights); add it to the family's ExpertTensor list")
        dense = [(key, info) for key, info in tensors.items() if key not in consumed]
        _check_dense(src_dir, skeleton, modules, dense)
        return cls(src_dir, config, spec, list(modules), num_experts, experts, dense)


def build_skeleton(config: Any, spec: ArchSpec) -> torch.nn.Module:
    """The runtime model on the meta device: the modules and shapes, no memory for weights."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    auto = AutoModelForSeq2SeqLM if spec.task == "seq2seq-lm" else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config)


def runtime_expert_shapes(spec: ArchSpec, module: torch.nn.Module, num_experts: int) -> dict[str, tuple]:
    """Runtime shape of each per-expert tensor of an experts module, by spec tensor name."""
    names = {t.name for t in spec.tensors}
    shapes: dict[str, tuple] = {}
    if spec.adapter == "switch":
        # One submodule per expert, each holding its own tensors.
        for e in range(num_experts):
            prefix = spec.expert_id.format(e=e) + "."
            for pname, param in module.named_parameters():
                if not pname.startswith(prefix):
                    continue
                name = pname[len(prefix):]
                if name not in names:
                    raise ValueError(f"{type(module).__name__} has parameter {pname!r} that "
                                     f"moeinf/spec.py does not list for family {spec.family!r}")
                shapes.setdefault(name, tuple(param.shape))
        expected = sum(1 for pname, _ in module.named_parameters())
        if expected != len(shapes) * num_experts:
            raise ValueError(f"{type(module).__name__} does not hold {num_experts} experts of "
                             f"{sorted(shapes)} (the config's number of experts)")
    else:
        # Fused runtime parameters [E, ...]: row e is expert e.
        for pname, param in module.named_parameters():
            if pname not in names:
                raise ValueError(f"{type(module).__name__} has parameter {pname!r} that moeinf/spec.py "
                                 f"does not list for family {spec.family!r}")
            if param.shape[0] != num_experts:
                raise ValueError(f"{type(module).__name__}.{pname} has {param.shape[0]} experts, the config "
                                 f"says {num_experts}")
            shapes[pname] = tuple(param.shape[1:])
    unknown = [t.name for t in spec.tensors if t.name not in shapes and not t.optional]
    if unknown:
        raise ValueError(f"moeinf/spec.py lists {unknown} for family {spec.family!r} but transformers' "
                         f"{type(module).__name__} has no such parameter; mark them optional or fix the spec")
    return shapes


def _runtime_keys(tensors: dict[str, TensorInfo], spec: ArchSpec) -> dict[str, TensorInfo]:
    out: dict[str, TensorInfo] = {}
    for key, info in tensors.items():
        runtime = spec.rename(key)
        if runtime in out:
            raise ValueError(f"two checkpoint tensors map to the runtime key {runtime!r} "
                             "(check checkpoint_renames in moeinf/spec.py)")
        out[runtime] = info
    return out


def _expert_tensor(spec: ArchSpec, module: str, e: int, t: ExpertTensor, shape: tuple, num_experts: int,
                   tensors: dict[str, TensorInfo], consumed: set[str]) -> SourceTensor:
    fused_key = f"{module}.{t.fused}" if t.fused else None
    if fused_key and fused_key in tensors:
        info = tensors[fused_key]
        if info.shape[:1] != (num_experts,) or info.shape[1:] != shape:
            raise ValueError(f"checkpoint tensor {fused_key!r} has shape {list(info.shape)}, expected "
                             f"{[num_experts, *shape]}")
        row = info.nbytes // num_experts
        consumed.add(fused_key)
        return SourceTensor(t.name, info.dtype, shape, ((info, e * row, (e + 1) * row),))
    keys = [f"{module}.{spec.expert_id.format(e=e)}.{suffix}" for suffix in t.per_expert]
    missing = [k for k in keys if k not in tensors]
    if not keys or missing:
        wanted = missing[0] if missing else fused_key
        raise ValueError(f"checkpoint tensor {wanted!r} is missing (expert {e} of {module}); the checkpoint "
                         "is incomplete or its layout is not the one moeinf/spec.py describes")
    infos = [tensors[k] for k in keys]
    dtypes = {info.dtype for info in infos}
    stacked = (sum(info.shape[0] for info in infos), *infos[0].shape[1:]) if infos[0].shape else ()
    if len(dtypes) != 1 or stacked != shape or any(i.shape[1:] != infos[0].shape[1:] for i in infos):
        described = ", ".join(f"{k} {i.dtype}{list(i.shape)}" for k, i in zip(keys, infos, strict=True))
        raise ValueError(f"checkpoint tensors {described} do not stack into the runtime shape {list(shape)} "
                         "of one dtype")
    consumed.update(keys)
    return SourceTensor(t.name, infos[0].dtype, shape, tuple((info, 0, info.nbytes) for info in infos))


def _check_dense(src_dir: Path, skeleton: torch.nn.Module, modules: dict[str, torch.nn.Module],
                 dense: list[tuple[str, TensorInfo]]) -> None:
    """Every dense checkpoint tensor is a runtime weight, and every runtime parameter outside the experts
    modules is in the checkpoint (under one of its tied names)."""
    state = skeleton.state_dict()
    keys = {key for key, _ in dense}
    for key, info in dense:
        if key not in state:
            raise ValueError(f"{src_dir}: checkpoint tensor {key!r} is not a weight of the transformers "
                             "model; add a checkpoint_renames entry to moeinf/spec.py if it was renamed")
        if tuple(state[key].shape) != info.shape:
            raise ValueError(f"{src_dir}: checkpoint tensor {key!r} has shape {list(info.shape)}, the model "
                             f"expects {list(state[key].shape)}")
    aliases: dict[int, list[str]] = {}
    for name, param in skeleton.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    prefixes = tuple(name + "." for name in modules)
    for names in aliases.values():
        if not names[0].startswith(prefixes) and not keys.intersection(names):
            raise ValueError(f"{src_dir}: the checkpoint has no tensor {names[0]!r} (nor a tied alias of it)")
