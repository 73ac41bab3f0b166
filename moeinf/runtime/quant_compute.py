"""Expert compute on a quantised store's experts (formats in `moeinf/store/quant.py`).

The kernels are torch's own CPU weight-only ones, chosen by `moeinf bench quant` (one expert's forward
at Qwen3-30B-A3B geometry, against bf16 `F.linear` and against dequantising to bf16 first):
`_weight_int8pack_mm` (int8, one scale per row) and `_weight_int4pack_mm_for_cpu` (int4, group-wise
scale and zero). Activations stay in the model dtype; only the weights are quantised. The gate function,
activation and post-expert norm are the exact kernel's, so nothing about a family is repeated here.

`OffloadConfig.quant_expert_kernel` "dynamic-int8" computes an int8 store's one-row calls (a decoded
token's expert) as an integer GEMV instead: the row is rounded to int8 with its own scale and multiplied
by the stored int8 weight with `torch._int_mm` (exact int32 sums), then rescaled. At one row this is
~0.85x the weight-only kernel's time on the expert shapes; at 2-4 rows it is slower, so calls of more rows
stay weight-only (bench/results/2026-11-25c-dense).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import QUANT_EXPERT_KERNELS
from ..store.quant import Quantization, padded_shape
from .compute import ExpertKernel, GatedKernel


def quantised_linear(x: torch.Tensor, tensors: Mapping[str, torch.Tensor], name: str, quant: Quantization,
                     shape: tuple[int, int]) -> torch.Tensor:
    """`x` [n, K] times the quantised weight `name` ([N, K] logically) transposed: [n, N]."""
    return quantised_matmul(x, tensors[f"{name}.qweight"], tensors[f"{name}.scales"], quant, shape)


def dynamic_int8_row(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`x` [1, K] rounded to int8 (one symmetric scale) times the int8 weight `qweight` [N, K] with
    per-row `scales` [N], transposed: [1, N] in `x`'s dtype."""
    wide = x.float()
    largest = wide.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)  # [1, 1]
    row_scale = largest / 127
    q = torch.round(wide / row_scale).to(torch.int8)  # [1, K]
    return (torch._int_mm(q, qweight.t()) * row_scale * scales).to(x.dtype)  # [1, N]


def quantised_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, quant: Quantization,
                     shape: tuple[int, int]) -> torch.Tensor:
    """`x` [n, K] times the weight [N, K] (`shape`) that `qweight` and `scales` quantise, transposed:
    [n, N]."""
    if quant.scheme == "int8":
        return torch.ops.aten._weight_int8pack_mm(x, qweight, scales)
    rows, cols = shape
    padded_rows, padded_cols = padded_shape(quant, shape)
    if padded_cols != cols:
        x = F.pad(x, (0, padded_cols - cols))  # the padded inputs have zero weights
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, qweight, quant.group_size, scales)
    return out[:, :rows] if padded_rows != rows else out


@dataclass(frozen=True)
class QuantisedGatedKernel(ExpertKernel):
    """A gated expert (gate/up projection, the module's gate function, down projection) on quantised
    weights; `exact` supplies the module's gate function and post-expert norm."""

    exact: GatedKernel
    quant: Quantization
    shapes: Mapping[str, tuple[int, int]]
    """Logical [N, K] of `gate_up_proj` and `down_proj` (the index's quantisation record)."""
    dynamic_rows: bool = False
    """One-row calls as an integer GEMV (`dynamic_int8_row`; int8 only)."""

    def __post_init__(self) -> None:
        if not self.exact.has_gate or self.exact.has_bias or self.exact.is_transposed:
            raise ValueError("quantised experts must be gated, without biases, stored [out, in] "
                             "(what `moeinf pack --quant` accepts)")
        if self.dynamic_rows and self.quant.scheme != "int8":
            raise ValueError(f"quant_expert_kernel 'dynamic-int8' needs an int8 store, not "
                             f"{self.quant.describe()}")

    def __call__(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.linear(x, tensors, "gate_up_proj")  # [n, 2I]
        h = self.exact.apply_gate(h)  # [n, I]
        out = self.linear(h, tensors, "down_proj")  # [n, H]
        return self.exact.post_norm(out) if self.exact.post_norm is not None else out

    def linear(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """`x` [n, K] times the expert's quantised weight `name`, transposed: [n, N]."""
        if self.dynamic_rows and x.shape[0] == 1:
            return dynamic_int8_row(x, tensors[f"{name}.qweight"], tensors[f"{name}.scales"])
        return quantised_linear(x, tensors, name, self.quant, self.shapes[name])


def quantised_kernel(kernel: ExpertKernel, quant: Quantization, shapes: Mapping[str, tuple[int, int]],
                     expert_kernel: str = "weight-only") -> ExpertKernel:
    """The kernel computing `kernel`'s experts from a store quantised with `quant`; `expert_kernel` one of
    `QUANT_EXPERT_KERNELS` ("auto": "dynamic-int8" for an int8 store, else "weight-only")."""
    if not isinstance(kernel, GatedKernel):
        raise ValueError(f"{type(kernel).__name__} experts cannot run from a quantised store; re-pack "
                         "without --quant")
    if expert_kernel not in QUANT_EXPERT_KERNELS:
        raise ValueError(f"quant_expert_kernel must be one of {QUANT_EXPERT_KERNELS}, got {expert_kernel!r}")
    if expert_kernel == "auto":
        expert_kernel = "dynamic-int8" if quant.scheme == "int8" else "weight-only"
    return QuantisedGatedKernel(kernel, quant, {name: tuple(shape) for name, shape in shapes.items()},
                                dynamic_rows=expert_kernel == "dynamic-int8")
