"""How the attention projections compute (`OffloadConfig.attention_linears`).

At one decoded row on a CPU, torch's bf16 `F.linear` can be a slow path: several times the time of the
float32 GEMV of the same shape, whose weights are twice the bytes. The
attention projections of a MoE model are small beside its experts, so they can be held in another form
at little memory cost:

- "model": as the model holds them (HF's computation, bit for bit);
- "float32": a float32 copy of the weight; the input is widened and the output rounded back to the model
  dtype. The sums run in float32 as in the bf16 kernel, in another order: not bit-equal to it;
- "int8": one int8 scale per output row (as a quantised store's int8 experts: a decoded row through
  moeinf's own GEMV where it runs, more rows through `_weight_int8pack_mm`): a quarter of float32's bytes,
  an approximation like the store's.

Attention modules are found by their class name (`...Attention`, transformers' convention for every
family); only their direct `nn.Linear` children in a half-precision dtype are replaced. Routers, experts,
shared experts and the LM head are other modules' business (`quant_dense`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ATTENTION_LINEARS
from ..kernels.quant_linear import QuantisedLinear
from ..store.quant import Quantization

HALF = (torch.bfloat16, torch.float16)


class Float32Linear(nn.Module):
    """`nn.Linear` computed in float32 on a float32 copy of a half-precision linear's weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().float(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(),
                                                                 requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight, self.bias).to(x.dtype)  # [..., out] in x's dtype

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float32"


def is_attention(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention")


def replace_attention_linears(model: nn.Module, mode: str) -> list[str]:
    """Replace every half-precision `nn.Linear` directly under an attention module of `model` as `mode`
    ("float32" or "int8") says; "model" replaces nothing. The replaced linears' names."""
    if mode not in ATTENTION_LINEARS or mode == "auto":
        raise ValueError(f"attention_linears must be resolved to one of {ATTENTION_LINEARS[1:]}, "
                         f"got {mode!r}")
    if mode == "model":
        return []
    targets = []
    for name, module in model.named_modules():
        if is_attention(module):
            targets += [(f"{name}.{child}", module, child, sub) for child, sub in module.named_children()
                        if type(sub) is nn.Linear and sub.weight.dtype in HALF]
    for _, parent, child, linear in targets:
        if mode == "float32":
            setattr(parent, child, Float32Linear(linear))
        else:
            setattr(parent, child, QuantisedLinear(linear, Quantization.of("int8")))
    return [name for name, *_ in targets]


def resolve(mode: str, quantised: bool) -> str:
    """`auto`: "int8" for a quantised store (approximate already), "model" for an exact one (whose
    outputs stay HF's)."""
    if mode not in ATTENTION_LINEARS:
        raise ValueError(f"attention_linears must be one of {ATTENTION_LINEARS}, got {mode!r}")
    if mode != "auto":
        return mode
    return "int8" if quantised else "model"
