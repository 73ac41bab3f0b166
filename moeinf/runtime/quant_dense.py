"""Dense linears on quantised weights beside a quantised store's experts (`OffloadConfig.quant_dense`).

A quantised store quantises the routed experts on disk; every other weight is stored exact. Some dense
weights cost as much per token as the routed experts: the shared experts (DeepSeek's `shared_experts`,
Qwen2-MoE's `shared_expert`) run for every token and, at DeepSeek/Qwen geometry, are as large as a routed
expert each; the LM head is the largest single matrix. Once quantisation has made the routed experts cheap,
these bf16 GEMVs are much of a decoded token's time. `quant_dense` quantises them at load time, with the
store's scheme and group size, into the same kernels (`quantised_matmul`); the dense file on disk stays
exact, routers stay exact (they decide the routing), and an exact store never does this.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..config import QUANT_DENSE
from ..hf.spec import ArchSpec
from ..store.quant import Quantization, quantise
from .quant_compute import quantised_matmul


class QuantisedLinear(nn.Module):
    """`nn.Linear` on a weight quantised with `quant` (the exact weight is dropped)."""

    def __init__(self, linear: nn.Linear, quant: Quantization) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.quant = quant
        self.shape = (int(weight.shape[0]), int(weight.shape[1]))
        parts = quantise(weight, quant)
        self.register_buffer("qweight", parts["qweight"])
        self.register_buffer("scales", parts["scales"])
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [n, K]
        if not flat.is_contiguous():
            flat = flat.contiguous()
        out = quantised_matmul(flat, self.qweight, self.scales, self.quant, self.shape)  # [n, N]
        out = out.reshape(*x.shape[:-1], self.shape[0])
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return f"in_features={self.shape[1]}, out_features={self.shape[0]}, {self.quant.describe()}"


def quantise_dense(model: nn.Module, spec: ArchSpec, quant: Quantization, which: str) -> list[str]:
    """Replace the linears `which` names (one of `QUANT_DENSE`) in `model` by quantised ones; their names.
    Shared experts are the modules `spec.shared_experts_module` names."""
    if which not in QUANT_DENSE:
        raise ValueError(f"quant_dense must be one of {QUANT_DENSE}, got {which!r}")
    targets: list[str] = []
    if which != "none" and spec.shared_experts_module is not None:
        for name, module in model.named_modules():
            if re.search(spec.shared_experts_module, name):
                targets += [f"{name}.{child}" for child, sub in module.named_children()
                            if type(sub) is nn.Linear]
    if which == "shared-experts+lm-head":
        head = model.get_output_embeddings()
        names = [name for name, module in model.named_modules() if module is head]
        if type(head) is nn.Linear and names:
            targets.append(names[0])
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantisedLinear(getattr(parent, child), quant))
    return targets
