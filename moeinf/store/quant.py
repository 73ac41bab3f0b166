"""Quantised expert formats of a store: int8 and int4 weights in the layouts torch's CPU kernels read.

A quantised store keeps everything else as it is (dense weights, the index, the blob alignment); only
the two projections of each gated expert (`gate_up_proj`, `down_proj`, [out, in]) are replaced by
`<name>.qweight` and `<name>.scales`:

- int8: symmetric, one scale per output row (`qweight` int8 [N, K], `scales` [N] in the model dtype),
  the operands of `torch.ops.aten._weight_int8pack_mm`. That kernel has no group-wise form, so the int8
  group is the whole row (`group_size` 0).
- int4: asymmetric, one (scale, zero) pair per `group_size` inputs of each row, w = (q - 8) * scale + zero,
  `qweight` uint8 [N', K'/2] already packed by `torch.ops.aten._convert_weight_to_int4pack_for_cpu`,
  `scales` [K'/G, N', 2] in the model dtype: the operands of `_weight_int4pack_mm_for_cpu`. The kernel
  needs N' % 16 == 0 and K' % G == 0, so rows and inputs are zero-padded up to those (N', K').

The int4 packing is the kernel's private layout and may differ between torch builds and CPU capabilities,
so the index records a probe: a hash of a fixed matrix packed at pack time. `check_runtime` refuses a store
whose probe the running torch does not reproduce (re-pack it).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .index import INDEX_NAME, TENSOR_ALIGNMENT, ExpertEntry, StoreError, StoreIndex, TensorEntry, align
from .reader import entry_tensors
from .safetensors_file import element_size

SCHEMES = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)
"""The group sizes `_weight_int4pack_mm_for_cpu` accepts."""
DEFAULT_GROUP_SIZE = {"int8": 0, "int4": 32}
QUANTISED = ("gate_up_proj", "down_proj")
"""The per-expert tensors a quantised store quantises ([out, in] weights of gated experts)."""
INT4_ROWS = 16
"""`_convert_weight_to_int4pack_for_cpu` needs a multiple of 16 rows."""
LAYOUTS = {"int8": "torch-int8pack-rowwise", "int4": "torch-int4pack-cpu"}


@dataclass(frozen=True)
class Quantization:
    """How a store's experts are quantised: `scheme` int8 or int4, `group_size` inputs per scale."""

    scheme: str
    group_size: int

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"quantisation scheme must be one of {SCHEMES}, got {self.scheme!r}")
        if self.scheme == "int8" and self.group_size != 0:
            raise ValueError("int8 uses one scale per output row (torch's CPU int8 kernel has no group-wise "
                             "form): leave the group size at 0")
        if self.scheme == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES} (what torch's CPU int4 "
                             f"kernel accepts), got {self.group_size}")

    @classmethod
    def of(cls, scheme: str, group_size: int | None = None) -> Quantization:
        """`scheme` with `group_size`, or that scheme's default group size when None."""
        if scheme not in SCHEMES:
            raise ValueError(f"quantisation scheme must be one of {SCHEMES}, got {scheme!r}")
        return cls(scheme, DEFAULT_GROUP_SIZE[scheme] if group_size is None else group_size)

    def describe(self) -> str:
        return f"{self.scheme} (group {self.group_size})" if self.group_size else f"{self.scheme} (per row)"

    def to_json(self, shapes: Mapping[str, tuple[int, int]]) -> dict[str, Any]:
        """The index record: scheme, group size, layout, the logical [N, K] of each tensor, the probe."""
        record: dict[str, Any] = {"scheme": self.scheme, "group_size": self.group_size,
                                  "layout": LAYOUTS[self.scheme],
                                  "shapes": {name: list(shape) for name, shape in shapes.items()}}
        if self.scheme == "int4":
            record["probe"] = int4_probe()
        return record

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> Quantization:
        return cls(record["scheme"], record["group_size"])


def padded_shape(quant: Quantization, shape: tuple[int, int]) -> tuple[int, int]:
    """[N', K'] the kernel computes on for a logical [N, K] weight."""
    rows, cols = shape
    if quant.scheme == "int8":
        return rows, cols
    return -(-rows // INT4_ROWS) * INT4_ROWS, -(-cols // quant.group_size) * quant.group_size


def quantised_layout(quant: Quantization, shape: tuple[int, int],
                     dtype: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """`{"qweight": (dtype, shape), "scales": (dtype, shape)}` of one quantised [N, K] weight."""
    rows, cols = padded_shape(quant, shape)
    if quant.scheme == "int8":
        return {"qweight": ("int8", (rows, cols)), "scales": (dtype, (rows,))}
    return {"qweight": ("uint8", (rows, cols // 2)), "scales": (dtype, (cols // quant.group_size, rows, 2))}


def quantise(weight: torch.Tensor, quant: Quantization) -> dict[str, torch.Tensor]:
    """`{"qweight", "scales"}` of `weight` [N, K]; scales in the weight's dtype (the compute dtype)."""
    if weight.dim() != 2:
        raise ValueError(f"only 2-D [out, in] weights are quantised, got shape {list(weight.shape)}")
    if quant.scheme == "int8":
        return _quantise_int8(weight)
    return _quantise_int4(weight, quant.group_size)


def _quantise_int8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    w = weight.float()
    # The scale is rounded to the compute dtype first so that the integers are fitted to the scale the
    # kernel will multiply by.
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(weight.dtype)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return {"qweight": q, "scales": scales}


def _quantise_int4(weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    rows, cols = padded_shape(Quantization("int4", group), tuple(weight.shape))
    w = torch.zeros(rows, cols, dtype=torch.float32)
    w[: weight.shape[0], : weight.shape[1]] = weight.float()
    grouped = w.reshape(rows, cols // group, group)  # [N', G', group]
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)  # [N', G']
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny).to(weight.dtype).float()
    zero = (low + 8 * scale).to(weight.dtype).float()
    q = torch.round((grouped - zero[..., None]) / scale[..., None] + 8).clamp(0, 15).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(rows, cols), 1)  # [N', K'/2]
    scales = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(weight.dtype)  # [G', N', 2]
    return {"qweight": packed, "scales": scales}


def int4_probe() -> str:
    """sha256 of a fixed 32 x 64 pattern packed by this torch: equal probes = the same packed layout."""
    pattern = (torch.arange(32 * 64, dtype=torch.int32).reshape(32, 64) * 7 + 3) % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(pattern, 1)
    return hashlib.sha256(packed.contiguous().numpy().tobytes()).hexdigest()[:32]


def check_runtime(record: Mapping[str, Any] | None, store_dir: object) -> Quantization | None:
    """The quantisation of a store's index record (None: exact), refusing one this torch cannot compute."""
    if record is None:
        return None
    try:
        quant = Quantization.from_json(record)
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreError(f"{store_dir}: unreadable quantisation record {dict(record)} ({exc}); re-pack it "
                         "with `moeinf pack --quant`") from exc
    if record.get("layout") != LAYOUTS[quant.scheme]:
        raise StoreError(f"{store_dir}: {quant.scheme} layout {record.get('layout')!r} is not "
                         f"{LAYOUTS[quant.scheme]!r}; re-pack it with this moeinf")
    if quant.scheme == "int4" and record.get("probe") != int4_probe():
        raise StoreError(f"{store_dir} was packed with another torch int4 weight layout than this torch "
                         f"{torch.__version__} uses ({torch.backends.cpu.get_cpu_capability()}); re-pack it "
                         "with `moeinf pack --quant int4` on this machine")
    return quant


def quantised_index(index: StoreIndex, quant: Quantization) -> StoreIndex:
    """The index of `index`'s experts quantised with `quant`: new tensors, offsets and sizes (checksums
    are filled in when the blobs are written)."""
    first = index.experts[0]
    if set(first.tensors) != set(QUANTISED):
        raise ValueError(f"--quant handles experts made of {list(QUANTISED)} ([out, in], no biases: "
                         f"Mixtral, Qwen-MoE, DeepSeek, OLMoE); {index.model_type} experts hold "
                         f"{sorted(first.tensors)}")
    shapes = {name: first.tensors[name].shape for name in QUANTISED}
    tensors: dict[str, TensorEntry] = {}
    end = 0
    for name in QUANTISED:
        for part, (dtype, shape) in quantised_layout(quant, shapes[name], index.dtype).items():
            start = align(end, TENSOR_ALIGNMENT)
            tensors[f"{name}.{part}"] = TensorEntry(dtype, shape, start)
            end = start + element_size(dtype) * math.prod(shape)
    size = align(end, index.alignment)
    experts = [replace(e, offset=i * size, size=size, nbytes=end, tensors=tensors)
               for i, e in enumerate(index.experts)]
    return replace(index, experts=experts, quant=quant.to_json(shapes))


def quantise_blob(exact: ExpertEntry, blob: memoryview, target: ExpertEntry, out: memoryview,
                  quant: Quantization) -> None:
    """Write the quantised tensors of the exact blob `blob` (laid out as `exact`) into `out` (as `target`).

    `out` must be zeroed: the gaps between tensors and the padding stay zeros.
    """
    source = entry_tensors(exact, blob)
    views = entry_tensors(target, out)
    for name in QUANTISED:
        for part, tensor in quantise(source[name], quant).items():
            views[f"{name}.{part}"].copy_(tensor)


def requested(setting: str, store_dir: Path) -> Quantization | None:
    """What `OffloadConfig.quant` asks of the store at `store_dir`: "auto" = what it holds (exact when it
    does not exist yet), "none" = exact, a scheme = that scheme (with the group size of an existing store
    of that scheme, else the default)."""
    held = None
    if (store_dir / INDEX_NAME).is_file():
        record = StoreIndex.load(store_dir).quant
        held = Quantization.from_json(record) if record is not None else None
    if setting == "auto":
        return held
    if setting == "none":
        return None
    return held if held is not None and held.scheme == setting else Quantization.of(setting)
