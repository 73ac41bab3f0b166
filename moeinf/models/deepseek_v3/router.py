"""Routers replaced by shorter computations of the same result (`OffloadConfig.fast_dense_modules`).

DeepSeek-V3's top-k router (transformers' `DeepseekV3TopkRouter`: sigmoid scores, a score-correction bias,
group-limited top-k, normalised top-k weights) runs ~20 small ops per layer and token, half of them to
mask the groups that `topk_group` of `n_group` leaves out. When every group is kept (`topk_group >=
n_group`, e.g. the single group of DeepSeek-V3-style models with `n_group` 1) the mask keeps every
score: `GroupFreeTopkRouter` skips it and returns the same tensors bit for bit (the top-k runs on the
same values), so it applies to exact stores too. It owns the router's own parameter and buffer under
their names, so the fingerprint and the look-ahead's router lookup are unchanged. A quantised store's
router scores a decoded row in one call of moeinf's kernels module instead (`one_row_kernel`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ... import _kernels
from ...kernels import gemv
from ...kernels.gemv import DTYPES

ROUTER_ATTRIBUTES = ("top_k", "num_experts", "hidden_dim", "routed_scaling_factor", "num_group", "topk_group",
                     "norm_topk_prob", "weight", "e_score_correction_bias")


class GroupFreeTopkRouter(nn.Module):
    """A group-limited sigmoid top-k router whose every group is kept, without the group mask."""

    def __init__(self, router: nn.Module, *, one_row_kernel: bool = False) -> None:
        super().__init__()
        self.top_k = int(router.top_k)
        self.hidden_dim = int(router.hidden_dim)
        self.num_experts = int(router.num_experts)
        self.routed_scaling_factor = router.routed_scaling_factor
        self.norm_topk_prob = bool(router.norm_topk_prob)
        self.weight = router.weight
        self.register_buffer("e_score_correction_bias", router.e_score_correction_bias)
        self._widened: tuple[tuple[int, int, torch.device], torch.Tensor] | None = None
        self._row: tuple[tuple, tuple | None] | None = None
        self.one_row_kernel = one_row_kernel
        """Score and pick a decoded row's experts with moeinf's kernels module (the logits, csrc/gemv.hpp; the
        scoring and top-k, csrc/mla.hpp): ~10 torch ops per layer fewer, and a router's [E, H] read once in
        the model's dtype where torch's float32 product of the widened copy took ~76 us at [64, 2048]; but
        its sums and sigmoid are its own, so a near tie may pick another expert than HF's router: quantised
        stores only (`replace_routers`)."""

    def weight_float32(self) -> torch.Tensor:
        """The weight in float32, as HF widens it at every call ([E, H] copied per token and layer); kept
        while the weight's storage, version (in-place writes) and device stay. Not a buffer: the module's
        parameters and buffers stay the router's own."""
        weight = self.weight
        key = (weight.data_ptr(), weight._version, weight.device)
        if self._widened is None or self._widened[0] != key:
            self._widened = key, weight.detach().type(torch.float32)
        return self._widened[1]

    def one_row(self, hidden_states: torch.Tensor) -> bool:
        """Whether a decoded row `hidden_states` [T, H] takes the kernels module's path (`one_row_kernel`)."""
        if not self.one_row_kernel or hidden_states.shape[0] != 1:
            return False
        return (hidden_states.device.type == "cpu" and hidden_states.dtype in DTYPES
                and self._row_arguments() is not None)

    def _row_arguments(self) -> tuple | None:
        """The kernels' arguments that do not change between decoded rows (the weight's and bias's
        addresses and dtypes, the shapes, the top-k's settings), or None where the parameters do not fit the
        kernels; kept while the weight and bias keep their storage and device (a router's ~15 attribute
        lookups and checks cost ~30 us inside a decoded token)."""
        weight, bias = self.weight, self.e_score_correction_bias
        key = (weight.data_ptr(), bias.data_ptr(), weight.device, bias.device)
        if self._row is not None and self._row[0] == key:
            return self._row[1]
        fits = (weight.device.type == bias.device.type == "cpu" and weight.dtype in DTYPES
                and bias.dtype in DTYPES and weight.is_contiguous() and bias.is_contiguous()
                and self.hidden_dim % 8 == 0 and gemv.available())
        arguments = (weight.data_ptr(), DTYPES[weight.dtype], bias.data_ptr(), DTYPES[bias.dtype],
                     self.num_experts, self.hidden_dim, self.top_k, self.norm_topk_prob,
                     float(self.routed_scaling_factor)) if fits else None
        self._row = key, arguments
        return arguments

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.view(-1, self.hidden_dim)  # [T, H]
        if self.one_row(hidden_states):
            # a decoded row: the logits (from the model's own weight, widened as they are read), scoring and
            # top-k in two calls of the kernels module
            weight, weight_type, bias_address, bias_type, experts, hidden, k, norm, scaling = self._row[1]
            row = hidden_states.contiguous()
            router_logits = torch.empty(1, experts)
            _kernels.dense_row_product(row.data_ptr(), DTYPES[row.dtype], weight, weight_type, experts,
                                       hidden, router_logits.data_ptr(), gemv._pool())
            weights = torch.empty(1, k)
            ids = torch.empty(1, k, dtype=torch.long)
            _kernels.sigmoid_topk(router_logits.data_ptr(), bias_address, bias_type, experts, k, norm,
                                  scaling, weights.data_ptr(), ids.data_ptr())
            return router_logits, weights, ids
        router_logits = F.linear(hidden_states.type(torch.float32), self.weight_float32())  # [T, E]
        scores = router_logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        topk_indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]  # [T, k]
        topk_weights = scores.gather(1, topk_indices)  # [T, k]
        if self.norm_topk_prob:
            denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
            topk_weights /= denominator
        topk_weights = topk_weights * self.routed_scaling_factor
        return router_logits, topk_weights, topk_indices


def is_group_free_topk_router(module: nn.Module) -> bool:
    """transformers' DeepSeek-V3 top-k router (whose math `GroupFreeTopkRouter` replays; other families'
    `...TopkRouter` copies may score differently, softmax for one) keeping every group."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    return (type(module) is DeepseekV3TopkRouter and all(hasattr(module, name) for name in ROUTER_ATTRIBUTES)
            and module.topk_group >= module.num_group)


def replace_routers(model: nn.Module, *, one_row_kernel: bool = False) -> list[str]:
    """Replace every group-limited top-k router of `model` that keeps all its groups by a
    `GroupFreeTopkRouter` (`one_row_kernel`: a quantised store's); the replaced modules' names."""
    targets = [name for name, module in model.named_modules() if is_group_free_topk_router(module)]
    for name in targets:
        router = GroupFreeTopkRouter(model.get_submodule(name), one_row_kernel=one_row_kernel)
        model.set_submodule(name, router)
    return targets
