"""Expert compute on a quantised store's experts (formats in `moeinf/store/quant.py`).

The kernels are torch's own CPU weight-only ones, chosen by `moeinf bench quant` (one expert's forward
at Qwen3-30B-A3B geometry, against bf16 `F.linear` and against dequantising to bf16 first):
`_weight_int8pack_mm` (int8, one scale per row) and `_weight_int4pack_mm_for_cpu` (int4, group-wise
scale and zero). Activations stay in the model dtype; only the weights are quantised. The gate function,
activation and post-expert norm are the exact kernel's, so nothing about a family is repeated here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..store.quant import Quantization, padded_shape
from .compute import ExpertKernel, GatedKernel


def quantised_linear(x: torch.Tensor, tensors: Mapping[str, torch.Tensor], name: str, quant: Quantization,
                     shape: tuple[int, int]) -> torch.Tensor:
    """`x` [n, K] times the quantised weight `name` ([N, K] logically) transposed: [n, N]."""
    return quantised_matmul(x, tensors[f"{name}.qweight"], tensors[f"{name}.scales"], quant, shape)


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

    def __post_init__(self) -> None:
        if not self.exact.has_gate or self.exact.has_bias or self.exact.is_transposed:
            raise ValueError("quantised experts must be gated, without biases, stored [out, in] "
                             "(what `moeinf pack --quant` accepts)")

    def __call__(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        h = quantised_linear(x, tensors, "gate_up_proj", self.quant, self.shapes["gate_up_proj"])  # [n, 2I]
        h = self.exact.apply_gate(h)  # [n, I]
        out = quantised_linear(h, tensors, "down_proj", self.quant, self.shapes["down_proj"])  # [n, H]
        return self.exact.post_norm(out) if self.exact.post_norm is not None else out


def quantised_kernel(kernel: ExpertKernel, quant: Quantization,
                     shapes: Mapping[str, tuple[int, int]]) -> ExpertKernel:
    """The kernel computing `kernel`'s experts from a store quantised with `quant`."""
    if not isinstance(kernel, GatedKernel):
        raise ValueError(f"{type(kernel).__name__} experts cannot run from a quantised store; re-pack "
                         "without --quant")
    return QuantisedGatedKernel(kernel, quant, {name: tuple(shape) for name, shape in shapes.items()})
