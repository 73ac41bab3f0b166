"""RMSNorms in torch's `rms_norm` (`OffloadConfig.fast_dense_modules`).

transformers' RMSNorm (Llama's form, which DeepSeek, Qwen-MoE, Mixtral and OLMoE copy) is eight small ops
per call: widen, square, mean, add eps, rsqrt, multiply, narrow, scale. At one decoded row each costs
~55 us on the e2e model's CPU, ~25 calls per token. `torch.nn.functional.rms_norm` on the widened input
does the middle in one call (~28 us with the same narrowing and scaling after it).

Exact stores (`TorchRMSNorm`): on CPU, torch 2.13's `rms_norm` of a float32 input runs the same ATen ops as
HF's middle (`_fused_rms_norm` calls pow, mean, add_, rsqrt, mul), so the result is HF's bit for bit, with
the per-op work in C++ instead of Python. A build whose `rms_norm` summed in another order would not be:
every norm is replaced only after `sums_as_hf` finds the two equal on rows whose float32 sum of squares
changes with the order of the additions (a large square among many small ones), and on CPU only.

Quantised stores (`FusedRMSNorm`, approximate already): a decoded row (one row, on CPU) takes one call of
moeinf's kernels module instead (csrc/mla.hpp: ~100 us against a few per call at one row, inside a decoded
token on an AVX2 EPYC), whose float32 sum runs in its own order.

Either replaces only a norm that computes the same as it on a probe: a family whose norm differs in form
(Gemma's `1 + weight`, an eps outside the root) keeps its own.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .. import _kernels
from .gemv import DTYPES

PROBE_ROWS = 4


class TorchRMSNorm(nn.Module):
    """`weight * rms_norm(x in float32).to(x.dtype)`: a Llama-form RMSNorm with its middle in torch's
    `rms_norm`; holds the norm's own weight."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = float(norm.variance_epsilon)
        self.shape = (int(norm.weight.shape[0]),)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(hidden_states.float(), self.shape, None, self.eps)  # [..., H] float32
        return self.weight * normed.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"{self.shape[0]}, eps={self.eps}, torch rms_norm"


class FusedRMSNorm(TorchRMSNorm):
    """`TorchRMSNorm` whose decoded row takes one call of the kernels module: quantised stores only."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.numel() == self.shape[0] and self.one_call(hidden_states):
            # a decoded row: one call of the kernels module (its float32 sum in another order: the
            # result may differ from torch's by a rounding step of the dtype)
            out = torch.empty_like(hidden_states)
            _kernels.rms_norm(hidden_states.data_ptr(), self.weight.data_ptr(), self.eps,
                              DTYPES[hidden_states.dtype], 1, self.shape[0], out.data_ptr())
            return out
        return super().forward(hidden_states)

    def one_call(self, hidden_states: torch.Tensor) -> bool:
        """A contiguous CPU input of the weight's dtype, one the kernels module reads."""
        weight = self.weight
        return (hidden_states.dtype == weight.dtype and hidden_states.dtype in DTYPES
                and hidden_states.device.type == "cpu" and weight.device.type == "cpu"
                and hidden_states.is_contiguous() and weight.is_contiguous())

    def extra_repr(self) -> str:
        return f"{self.shape[0]}, eps={self.eps}, fused"


@functools.lru_cache(maxsize=64)
def sums_as_hf(width: int, eps: float) -> bool:
    """Whether torch's `rms_norm` of float32 rows of `width` equals HF's ops on them (on CPU), bit for bit,
    on rows whose sum of squares depends on the order of the additions: a few large values among ones,
    at positions across the row (lanes, blocks and tail of a vectorised sum)."""
    rows = []
    step = max(1, width // 24)
    for position in range(0, width, step):
        for large in (4096.0, 2896.3, 45.25):
            row = torch.full((width,), 1.0)
            row[position] = large
            row[(position * 7 + 3) % width] = -large / 3
            rows.append(row)
    rows.append(torch.randn(width, generator=torch.Generator().manual_seed(0)) * 7)
    wide = torch.stack(rows)
    hf = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return torch.equal(F.rms_norm(wide, (width,), None, eps), hf)


def is_llama_form(norm: nn.Module, candidate: TorchRMSNorm) -> bool:
    """Whether `norm` computes what `candidate` does on a seeded probe, bit for bit and in the same dtype,
    with inputs in the weight's dtype and in bfloat16 (DeepSeek-V4 keeps float32 weights over bf16 inputs
    and returns the input's dtype)."""
    weight = norm.weight
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(PROBE_ROWS, weight.shape[0], generator=generator)
    with torch.inference_mode():
        for dtype in dict.fromkeys((weight.dtype, torch.bfloat16)):
            ours, theirs = candidate(probe.to(dtype)), norm(probe.to(dtype))
            if ours.dtype != theirs.dtype or not torch.equal(ours, theirs):
                return False
    return True


def replace_norms(model: nn.Module, *, exact: bool = False) -> list[str]:
    """Replace every RMSNorm of `model` (a module named `...RMSNorm` with a 1-D `weight` and a
    `variance_epsilon`) that computes as its replacement on the probe: `TorchRMSNorm` where `exact` (and
    torch's sums are HF's, `sums_as_hf`), else `FusedRMSNorm`; the replaced modules' names."""
    targets = []
    make = TorchRMSNorm if exact else FusedRMSNorm
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")
                and isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.device.type == "cpu"):
            candidate = make(module)
            if exact and not sums_as_hf(candidate.shape[0], candidate.eps):
                continue
            if is_llama_form(module, candidate):
                targets.append((name, candidate))
    for name, candidate in targets:
        model.set_submodule(name, candidate)
    return [name for name, _ in targets]
