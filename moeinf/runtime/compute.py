"""Exact expert compute on one expert's tensors, and grouping of routed tokens by expert.

An `ExpertKernel` turns the routed hidden states of one expert into its output, given that expert's
tensors in the store's runtime layout (`moeinf/hf/spec.py`). The math is the eager loop of the HF experts
classes (`transformers/integrations/moe.py`): gate/up projection, the module's own gate function, down
projection, then the router weight; the caller accumulates with `index_add_` exactly as HF does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class ExpertKernel(ABC):
    """Computes one expert: `[n, H]` routed states + that expert's tensors -> `[n, H]` outputs."""

    @abstractmethod
    def __call__(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor: ...


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            transposed: bool) -> torch.Tensor:
    # Transposed experts (GPT-OSS) store [in, out]; the others [out, in] as nn.Linear does.
    out = x @ weight if transposed else F.linear(x, weight)
    return out + bias if bias is not None else out


@dataclass(frozen=True)
class GatedKernel(ExpertKernel):
    """Experts of the transformers experts interface (Mixtral, Qwen-MoE, DeepSeek, OLMoE, GPT-OSS...).

    The flags and the gate function are read from the original experts module so that nothing about a
    family is repeated here: `apply_gate` is the module's `_apply_gate` (concatenated or interleaved
    gate/up, clamps, alpha), `act` its `act_fn` for ungated experts, `post_norm` its optional post-expert
    norm.
    """

    has_gate: bool
    has_bias: bool
    is_transposed: bool
    apply_gate: Callable[[torch.Tensor], torch.Tensor] | None
    act: Callable[[torch.Tensor], torch.Tensor] | None
    post_norm: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        up_name = "gate_up_proj" if self.has_gate else "up_proj"
        up_bias = tensors[f"{up_name}_bias"] if self.has_bias else None
        h = _linear(x, tensors[up_name], up_bias, self.is_transposed)  # [n, 2I] or [n, I]
        h = self.apply_gate(h) if self.has_gate else self.act(h)  # [n, I]
        down_bias = tensors["down_proj_bias"] if self.has_bias else None
        out = _linear(h, tensors["down_proj"], down_bias, self.is_transposed)  # [n, H]
        return self.post_norm(out) if self.post_norm is not None else out


@dataclass(frozen=True)
class DenseActDenseKernel(ExpertKernel):
    """Switch Transformers experts: `wo(act(wi(x)))` (dropout is the identity at inference)."""

    act: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        wo = tensors["wo.weight"]
        h = self.act(F.linear(x, tensors["wi.weight"]))  # [n, d_ff]
        return F.linear(h.to(wo.dtype), wo)  # [n, d_model]


@dataclass(frozen=True)
class Routed:
    """The tokens of one expert in one layer: rows of the flattened batch and their top-k slot."""

    token_idx: torch.Tensor  # [n] rows of hidden_states
    slot: torch.Tensor  # [n] position in top_k_index


def group_by_expert(top_k_index: torch.Tensor, num_experts: int) -> dict[int, Routed]:
    """Group the (token, slot) pairs of `top_k_index` [T, k] by expert, once per layer.

    Indices outside `[0, num_experts)` (HF's sentinel, or a token dropped by Switch's capacity) are skipped.
    Experts come in increasing id order, as in HF's loop.
    """
    flat = top_k_index.reshape(-1)  # [T*k]
    k = top_k_index.shape[-1]
    valid = (flat >= 0) & (flat < num_experts)
    pairs = torch.nonzero(valid).squeeze(-1)  # [S]
    experts = flat[pairs]
    order = torch.argsort(experts, stable=True)
    pairs, experts = pairs[order], experts[order]
    ids, counts = torch.unique_consecutive(experts, return_counts=True)
    groups: dict[int, Routed] = {}
    start = 0
    for expert, count in zip(ids.tolist(), counts.tolist(), strict=True):
        chunk = pairs[start : start + count]
        groups[expert] = Routed(token_idx=chunk // k, slot=chunk % k)
        start += count
    return groups


def accumulate(out: torch.Tensor, hidden_states: torch.Tensor, routed: Routed, top_k_weights: torch.Tensor,
               kernel: ExpertKernel, tensors: dict[str, torch.Tensor]) -> None:
    """Compute one expert on its tokens and add its weighted output into `out` [T, H], as HF does."""
    x = hidden_states[routed.token_idx]  # [n, H]
    y = kernel(x, tensors)  # [n, H]
    y = y * top_k_weights[routed.token_idx, routed.slot, None]
    out.index_add_(0, routed.token_idx, y.to(out.dtype))
