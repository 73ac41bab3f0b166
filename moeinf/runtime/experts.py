"""The offloaded experts modules that replace a model's experts, one per MoE layer and instance.

They keep the call signature of the module they replace, so the unmodified HF MoE block (router, shared
experts, dense first layers...) calls them as it called the original; they hold no expert weights.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from ..kernels.moe import ExpertKernel
from .offloader import Offloader
from .shared import EarlyShared


class OffloadedExperts(nn.Module):
    """Experts-interface module: `forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`."""

    def __init__(self, layer: int, num_experts: int, kernel: ExpertKernel, offloader: Offloader) -> None:
        super().__init__()
        self.layer = layer
        self.num_experts = num_experts
        self.kernel = kernel
        self.offloader = offloader
        self.early_shared: EarlyShared | None = None
        """The block's shared experts, to compute while this layer waits for a read (`runtime.shared`)."""

    def _idle(self, hidden_states: torch.Tensor) -> Callable[[], None] | None:
        """Arms the block's early shared experts; what the layer's wait may run (None: nothing)."""
        early = self.early_shared
        if early is None:
            return None
        early.arm()
        return partial(early.compute, hidden_states)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if hidden_states.dim() > 2:  # DBRX passes [B, L, H] and takes its output in that shape
            flat = hidden_states.reshape(-1, hidden_states.shape[-1])
            out = self.offloader.run_layer(self.layer, flat, top_k_index, top_k_weights, self.kernel,
                                           idle=self._idle(flat))
            return out.view(hidden_states.shape)
        return self.offloader.run_layer(self.layer, hidden_states, top_k_index, top_k_weights, self.kernel,
                                        idle=self._idle(hidden_states))

    def extra_repr(self) -> str:
        return f"layer={self.layer}, num_experts={self.num_experts}, offloaded"


class OffloadedSwitchExperts(OffloadedExperts):
    """Switch Transformers experts: the router (kept, with its expert capacity) passes a one-hot dispatch
    mask `[T, 1, E]` (all zeros for a token over capacity) and the top-1 probability `[T, 1]`.

    Dropped tokens get expert id -1: they are neither computed nor counted, and their output stays zero,
    as in HF.
    """

    def forward(self, hidden_states: torch.Tensor, selected_experts: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        dispatch = selected_experts.reshape(hidden_states.shape[0], -1)  # [T, E]
        kept = dispatch.sum(dim=-1, keepdim=True) > 0  # [T, 1]
        top_k_index = torch.where(kept, dispatch.argmax(dim=-1, keepdim=True), -1)  # [T, 1]
        return self.offloader.run_layer(self.layer, hidden_states, top_k_index, routing_weights, self.kernel,
                                        idle=self._idle(hidden_states))
