"""A HuggingFace checkpoint seen as the store will hold it: experts by (layer, expert), dense tensors
under their runtime keys, each as byte ranges of the source shards (nothing is read here).

The runtime model says what must exist: its skeleton, built on the meta device from config.json,
gives the experts modules (their order in `named_modules()` is the MoE-layer ordinal), the number of
experts and the runtime shape of each per-expert tensor. How the checkpoint names them is what
transformers' own weight conversion mapping says (`get_model_conversion_mapping`: renamed modules,
per-expert tensors merged into a fused one), completed by the spec table (`moeinf/spec.py`) for
layouts transformers does not convert. Every per-expert runtime tensor is a concatenation of contiguous
byte ranges of the checkpoint: whole per-expert tensors stacked along dim 0 (gate rows then up rows), or
row e of a fused [E, ...] tensor. A conversion that would need arithmetic on the bytes (a transpose, an
interleave, a split of a dense tensor) is refused with the name of the operation.
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
    stored_shape: tuple[int, ...] | None = None
    """Set when the bytes hold a [rows, cols] grid of equal elements the packer transposes into `shape`."""

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
        tensors, merged = hub_layout(skeleton, checkpoint_tensors(src_dir), spec)
        consumed: set[str] = set()
        experts = []
        for name, module in modules.items():
            shapes = runtime_expert_shapes(spec, module, num_experts)
            experts.append([[_expert_tensor(spec, name, e, t, shapes[t.name], num_experts, tensors, merged,
                                            consumed)
                             for t in spec.tensors if t.name in shapes] for e in range(num_experts)])
            stray = sorted(k for k in tensors if k.startswith(name + ".") and k not in consumed
                           and not (spec.dense_params and re.fullmatch(spec.dense_params, k[len(name) + 1:])))
            if stray:
                raise ValueError(
                    f"{src_dir}: checkpoint tensor {stray[0]!r} is under the experts module {name} but "
                    "moeinf/spec.py does not describe it (a quantized checkpoint? moeinf stores "
                    "unquantized weights); add it to the family's ExpertTensor list")
        unmerged = sorted(key for key in merged if key not in consumed)
        if unmerged:
            raise ValueError(f"{src_dir}: per-expert checkpoint tensors merge into {unmerged[0]!r}, which is "
                             "not an expert tensor of the model moeinf/spec.py describes")
        dense = [(key, info) for key, info in tensors.items() if key not in consumed]
        _check_dense(src_dir, skeleton, modules, dense)
        return cls(src_dir, config, spec, list(modules), num_experts, experts, dense)


def build_skeleton(config: Any, spec: ArchSpec) -> torch.nn.Module:
    """The runtime model on the meta device: the modules and shapes, no memory for weights."""
    with torch.device("meta"):
        return spec.auto_class().from_config(config)


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
        # Fused runtime parameters [E, ...]: row e is expert e (or block e of [E*n, ...] rows: `stacked`).
        stacked = {t.name for t in spec.tensors if t.stacked}
        spare = {t.name for t in spec.tensors if t.spare_rows}
        for pname, param in module.named_parameters():
            if spec.dense_params and re.fullmatch(spec.dense_params, pname):
                continue
            if pname not in names:
                raise ValueError(f"{type(module).__name__} has parameter {pname!r} that moeinf/spec.py "
                                 f"does not list for family {spec.family!r}")
            if pname in stacked and param.shape[0] % num_experts == 0:
                shapes[pname] = (param.shape[0] // num_experts, *param.shape[1:])
                continue
            if param.shape[0] != num_experts and not (pname in spare and param.shape[0] > num_experts):
                raise ValueError(f"{type(module).__name__}.{pname} has {param.shape[0]} experts, the config "
                                 f"says {num_experts}")
            shapes[pname] = tuple(param.shape[1:])
    unknown = [t.name for t in spec.tensors if t.name not in shapes and not t.optional]
    if unknown:
        raise ValueError(f"moeinf/spec.py lists {unknown} for family {spec.family!r} but transformers' "
                         f"{type(module).__name__} has no such parameter; mark them optional or fix the spec")
    return shapes


@dataclass
class MergedTensor:
    """Per-expert checkpoint tensors that transformers merges into one fused runtime tensor."""

    patterns: list[str]
    """transformers' source patterns (`mlp.experts.*.gate_proj.weight`), one per part (gate 0, up 1)."""
    parts: dict[int, dict[int, tuple[str, TensorInfo]]]
    """expert -> part -> (checkpoint key, tensor)."""

    def key(self, expert: int, part: int) -> str:
        """The checkpoint key of (expert, part), named after a tensor the checkpoint has."""
        key, pattern = next((k, self.patterns[p])
                            for parts in self.parts.values() for p, (k, _) in parts.items())
        wanted = self.patterns[part].replace("\\", "").replace("*", str(expert))
        found = re.search(_pattern_regex(pattern), key)
        return key[:found.start()] + wanted + key[found.end():] if found else wanted


Merged = dict[str, MergedTensor]
"""Runtime key of a fused experts tensor -> its per-expert checkpoint tensors."""


def _pattern_regex(pattern: str) -> str:
    """transformers' source pattern (a regex whose `*` is the expert index) with the index captured."""
    return pattern.replace("*", r"(\d+)")

_PACKABLE_OPS = (("MergeModulelist",), ("MergeModulelist", "Concatenate"))
"""Conversions the packer reproduces with byte ranges: stack per-expert tensors along dim 0 (one per
expert), then concatenate the parts along dim 1 (gate rows then up rows of each expert)."""


def hub_layout(skeleton: torch.nn.Module, tensors: dict[str, TensorInfo], spec: ArchSpec
               ) -> tuple[dict[str, TensorInfo], Merged]:
    """Checkpoint tensors under their runtime keys, as transformers loads them: `plain` tensors keep their
    bytes (renamed), `merged` per-expert tensors are parts of a fused runtime tensor."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(skeleton)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    state = skeleton.state_dict()
    prefix = skeleton.base_model_prefix
    plain: dict[str, TensorInfo] = {}
    merged: Merged = {}
    for key, info in tensors.items():
        runtime, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if runtime not in state and key in state:  # as transformers: a key that needed no renaming
            runtime, pattern = rename_source_key(key, [], [], prefix, state)
        runtime = spec.rename(runtime)
        if pattern is None:
            if runtime in plain:
                raise ValueError(f"two checkpoint tensors map to the runtime key {runtime!r} "
                                 "(check checkpoint_renames in moeinf/spec.py)")
            plain[runtime] = info
            continue
        converter = by_pattern[pattern]
        moved = _experts_transpose(converter.operations, runtime, info, state, spec)
        if moved is not None:
            plain[runtime] = moved
            continue
        ops = tuple(type(op).__name__ for op in converter.operations)
        dims = [getattr(op, "dim", 0) for op in converter.operations]
        if ops not in _PACKABLE_OPS or dims != [0, 1][:len(ops)]:
            raise ValueError(f"checkpoint tensor {key!r} becomes {runtime!r} through {list(ops)} "
                             f"(transformers' conversion of {pattern!r}); moeinf packs byte ranges and "
                             "cannot reproduce that: save the model with transformers in its runtime layout")
        renamed = rename_source_key(key, renamings, [], None, None)[0]
        found = re.search(_pattern_regex(pattern), renamed)
        if found is None:
            raise ValueError(f"checkpoint tensor {key!r} matched {pattern!r} without an expert index")
        entry = merged.setdefault(runtime, MergedTensor(list(converter.source_patterns), {}))
        part = converter.source_patterns.index(pattern)
        entry.parts.setdefault(int(found.group(1)), {})[part] = (key, info)
    return plain, merged


@dataclass(frozen=True)
class TransposedInfo(TensorInfo):
    """A fused experts tensor [E, ...] whose expert blocks transformers transposes on load: `shape` is the
    runtime shape, `stored_shape` [E, rows, cols] the grid of equal elements each block holds, which the
    packer transposes to [cols, rows] (Qwen3-VL-MoE's [E, in, out] tensors: elements are numbers; a
    gate/up interleave: rows of the hidden size in an [I, 2] grid)."""

    stored_shape: tuple[int, ...] = ()


def _experts_transpose(operations: list, runtime: str, info: TensorInfo, state: dict, spec: ArchSpec
                       ) -> TensorInfo | None:
    """`info` as the packer reads it when transformers' conversion only transposes each expert's block of a
    fused [E, a, b] experts tensor (Transpose of dims 1 and 2, or Interleave of dim 1); None otherwise."""
    from transformers.core_model_loading import Interleave, Transpose

    owner = runtime.rsplit(".", 1)[0]
    if (len(operations) != 1 or runtime not in state or len(info.shape) != 3
            or not re.fullmatch(spec.experts_module, owner)):
        return None
    op, (e, rows, cols) = operations[0], info.shape
    if isinstance(op, Transpose) and {op.dim0 % 3, op.dim1 % 3} == {1, 2}:
        if op.check_dims and tuple(state[runtime].shape) == info.shape:
            return info
        return TransposedInfo(info.path, info.dtype, (e, cols, rows), info.start, info.end, (e, rows, cols))
    if isinstance(op, Interleave) and op.dim % 3 == 1 and not op.inverse and rows % 2 == 0:
        return TransposedInfo(info.path, info.dtype, info.shape, info.start, info.end, (e, rows // 2, 2))
    return None


def _expert_tensor(spec: ArchSpec, module: str, e: int, t: ExpertTensor, shape: tuple, num_experts: int,
                   tensors: dict[str, TensorInfo], merged: Merged, consumed: set[str]) -> SourceTensor:
    fused_key = f"{module}.{t.fused}" if t.fused else None
    if fused_key and fused_key in tensors:
        info = tensors[fused_key]
        expected = (num_experts * shape[0], *shape[1:]) if t.stacked else (num_experts, *shape)
        if t.spare_rows and info.shape[1:] == expected[1:] and info.shape[0] > num_experts:
            expected = info.shape  # rows past the routed experts: no token reaches them, none is stored
        if info.shape != expected:
            raise ValueError(f"checkpoint tensor {fused_key!r} has shape {list(info.shape)}, expected "
                             f"{list(expected)}")
        row = info.nbytes // (info.shape[0] if t.spare_rows else num_experts)
        consumed.add(fused_key)
        stored = tuple(info.stored_shape[1:]) if isinstance(info, TransposedInfo) else None
        return SourceTensor(t.name, info.dtype, shape, ((info, e * row, (e + 1) * row),), stored)
    if fused_key and fused_key in merged:
        entry = merged[fused_key]
        parts = entry.parts.get(e, {})
        missing = [p for p in range(len(entry.patterns)) if p not in parts]
        if missing:
            raise ValueError(f"checkpoint tensor {entry.key(e, missing[0])!r} is missing (expert {e} of "
                             f"{module}); the checkpoint is incomplete")
        consumed.add(fused_key)
        keys, infos = zip(*(parts[p] for p in range(len(entry.patterns))), strict=True)
        return _stacked(t.name, list(keys), list(infos), shape)
    keys = [f"{module}.{spec.expert_id.format(e=e)}.{suffix}" for suffix in t.per_expert]
    missing = [k for k in keys if k not in tensors]
    if not keys or missing:
        wanted = missing[0] if missing else fused_key
        raise ValueError(f"checkpoint tensor {wanted!r} is missing (expert {e} of {module}); the checkpoint "
                         "is incomplete or its layout is not the one moeinf/spec.py describes")
    consumed.update(keys)
    return _stacked(t.name, keys, [tensors[k] for k in keys], shape)


def _stacked(name: str, keys: list[str], infos: list[TensorInfo], shape: tuple) -> SourceTensor:
    """Whole checkpoint tensors concatenated along dim 0 into one runtime tensor of `shape`."""
    dtypes = {info.dtype for info in infos}
    stacked = (sum(info.shape[0] for info in infos), *infos[0].shape[1:]) if infos[0].shape else ()
    if len(dtypes) != 1 or stacked != shape or any(i.shape[1:] != infos[0].shape[1:] for i in infos):
        described = ", ".join(f"{k} {i.dtype}{list(i.shape)}" for k, i in zip(keys, infos, strict=True))
        raise ValueError(f"checkpoint tensors {described} do not stack into the runtime shape {list(shape)} "
                         "of one dtype")
    return SourceTensor(name, infos[0].dtype, shape, tuple((info, 0, info.nbytes) for info in infos))


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
