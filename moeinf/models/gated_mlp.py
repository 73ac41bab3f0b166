"""A gated MLP's gate and up products as one, bit-equal (`OffloadConfig.fast_dense_modules`, exact stores).

transformers' gated MLPs (a DeepSeek layer's shared experts, the dense layers of DeepSeek and Qwen-MoE)
compute `down(act(gate(x)) * up(x))` in three products. At one decoded row each is a GEMV streaming its
weight, and inside a token each call also pays dispatch and a wake of torch's threads: one product over
`[gate; up]` streams the same bytes in one call. In torch's CPU bf16/fp16 GEMM each output is one dot
product of a weight row and the input, so the products of the stacked weight are the products of its
halves bit for bit; `ConcatGatedMLP` checks that on its own weights at construction and is not made where
it fails (float32's MKL GEMM blocks over rows).

Only one-row calls (decode steps) take the stacked product: the activation of a `[1, I]` view of it is
that of the `[1, I]` tensor HF's gate product returns, element for element in the same vector lanes; with
more rows the view's rows are not contiguous with each other and torch's elementwise loop could split them
in other places, so those calls run HF's three products. `gate_proj` and `up_proj` keep their names and
are views of the stacked weight: nothing is stored twice.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import bf16_rows
from ..kernels.moe import BATCHED_EXACT_DTYPES, bits
from ..kernels.quant_linear import is_fusable_mlp

_CHECK_INPUTS = 3


class ConcatGatedMLP(nn.Module):
    """Wraps a gated MLP (`inner`) whose gate and up weights become the two halves of one `[2I, H]` weight."""

    def __init__(self, inner: nn.Module, *, row_kernel: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.product = bf16_rows.linear if row_kernel else nn.functional.linear
        """`F.linear`, or `bf16_rows.linear` (the same bits): `OffloadConfig.bf16_row_kernel`."""
        gate, up = inner.gate_proj, inner.up_proj
        self.intermediate = int(gate.weight.shape[0])
        weight = torch.cat([gate.weight.detach(), up.weight.detach()])  # [2I, H]
        self.gate_up_weight = nn.Parameter(weight, requires_grad=False)
        gate.weight = nn.Parameter(weight[:self.intermediate], requires_grad=False)  # views: one copy
        up.weight = nn.Parameter(weight[self.intermediate:], requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() != x.shape[-1]:
            return self.inner(x)
        gate, up = self.product(x, self.gate_up_weight).split(self.intermediate, dim=-1)  # [.., I]
        return self.inner.down_proj(self.inner.act_fn(gate) * up)


def stacks_exactly(mlp: nn.Module) -> bool:
    """Whether `mlp`'s gate and up products over one stacked weight give a row the bits of the two apart:
    CPU, bf16/fp16, and checked on a few random rows."""
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    if gate.device.type != "cpu" or gate.dtype not in BATCHED_EXACT_DTYPES or up.dtype != gate.dtype \
            or up.shape != gate.shape:
        return False
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(_CHECK_INPUTS, 1, gate.shape[1], generator=generator).to(gate.dtype)  # one row each
    with torch.no_grad():
        stacked = nn.functional.linear(x, torch.cat([gate, up]))
        apart = torch.cat([nn.functional.linear(x, gate), nn.functional.linear(x, up)], dim=-1)
    return torch.equal(bits(stacked), bits(apart))


def concat_gated_mlps(model: nn.Module, *, row_kernel: bool = False) -> list[str]:
    """Replace every gated MLP of `model` whose products stack exactly by a `ConcatGatedMLP` (`row_kernel`:
    its stacked product by `bf16_rows`); their names."""
    targets = [name for name, module in model.named_modules()
               if is_fusable_mlp(module) and stacks_exactly(module)]
    for name in targets:
        model.set_submodule(name, ConcatGatedMLP(model.get_submodule(name), row_kernel=row_kernel))
    return targets
