"""RMSNorms in torch's `rms_norm`: HF's bit for bit for exact stores, in moeinf's kernels for a quantised
store's decoded row (moeinf/kernels/norms.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from moeinf import MoE, OffloadConfig
from moeinf.kernels import norms
from moeinf.kernels.norms import FusedRMSNorm, TorchRMSNorm, replace_norms


class GemmaFormRMSNorm(nn.Module):
    """An RMSNorm of another form: scales by `1 + weight` (Gemma's)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(size, generator=torch.Generator().manual_seed(1)) * 0.1)
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return ((1 + self.weight.float()) * wide).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_llama_form_norms_are_replaced_and_compute_as_before(dtype: torch.dtype) -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    model = nn.Module()
    model.deepseek, model.qwen = DeepseekV3RMSNorm(96, eps=1e-6), Qwen3MoeRMSNorm(96, eps=1e-5)
    model.gemma = GemmaFormRMSNorm(96)
    for norm in (model.deepseek, model.qwen):
        norm.weight.data = torch.randn(96, generator=torch.Generator().manual_seed(2))
    model.to(dtype)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3)).to(dtype) * 3
    want = {name: getattr(model, name)(x) for name in ("deepseek", "qwen", "gemma")}
    assert sorted(replace_norms(model)) == ["deepseek", "qwen"]
    assert isinstance(model.deepseek, FusedRMSNorm) and isinstance(model.gemma, GemmaFormRMSNorm)
    for name, value in want.items():  # bit for bit here (a probe decided the replacement)
        assert torch.equal(getattr(model, name)(x), value), name


def test_only_a_quantised_store_with_fast_dense_modules_fuses_its_norms(tiny_model_dir,
                                                                        tmp_path: Path) -> None:
    """A quantised store's norms take the kernels module's row; an exact store's take torch's `rms_norm`
    only (HF's sums); without fast_dense_modules both keep HF's."""
    model_dir = tiny_model_dir("deepseek_v3", dtype="bfloat16")
    counts = {}
    for quant, fast in (("none", True), ("int8", True), ("int8", False), ("none", False)):
        config = OffloadConfig(offload_dir=str(tmp_path / quant), quant=quant, fast_dense_modules=fast)
        with MoE(model_dir, config) as moe:
            counts[quant, fast] = [sum(type(m) is cls for m in moe.model.modules())
                                   for cls in (FusedRMSNorm, TorchRMSNorm)]
    assert counts["int8", True][0] > 0 and counts["int8", True][1] == 0
    assert counts["none", True] == [0, counts["int8", True][0]]  # every norm, none fused with the kernels
    assert counts["int8", False] == counts["none", False] == [0, 0]


def order_sensitive_rows(width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows whose float32 sum of squares changes with the order of the additions (a large value among
    small ones, at every position), plus random ones."""
    rows = torch.full((width, width), 0.75)
    rows[torch.arange(width), torch.arange(width)] = 3000.0
    noise = torch.randn(8, width, generator=torch.Generator().manual_seed(6)) * 5
    return torch.cat([rows, noise]).to(dtype)


@pytest.mark.parametrize("width", [2048, 64, 37])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_an_exact_stores_norm_is_hfs_bit_for_bit(width: int, dtype: torch.dtype) -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    model = nn.Module()
    model.norm = DeepseekV3RMSNorm(width, eps=1e-6)
    model.norm.weight.data = torch.randn(width, generator=torch.Generator().manual_seed(7))
    model.to(dtype)
    rows = order_sensitive_rows(width, dtype)
    want = model.norm(rows)
    assert replace_norms(model, exact=True) == ["norm"] and type(model.norm) is TorchRMSNorm
    assert torch.equal(model.norm(rows), want)
    assert torch.equal(model.norm(rows[:1].unsqueeze(0)), want[:1].unsqueeze(0))  # a decoded row [1, 1, H]


def test_a_torch_that_sums_in_another_order_keeps_hfs_norms(monkeypatch) -> None:
    """Were torch's `rms_norm` to sum the squares in another order (here one by one, left to right), the
    exact replacement would not be HF's bit for bit: the probe finds it and keeps HF's norm."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    def in_order(x: torch.Tensor, shape: tuple[int, ...], weight: object, eps: float) -> torch.Tensor:
        total = torch.zeros(x.shape[:-1] + (1,))
        for i in range(x.shape[-1]):
            total = total + x[..., i:i + 1] * x[..., i:i + 1]
        return x * torch.rsqrt(total / x.shape[-1] + eps)

    norms.sums_as_hf.cache_clear()
    monkeypatch.setattr(norms.F, "rms_norm", in_order)
    try:
        assert not norms.sums_as_hf(256, 1e-6)
        model = nn.Module()
        model.norm = DeepseekV3RMSNorm(256, eps=1e-6)
        assert replace_norms(model, exact=True) == [] and type(model.norm) is DeepseekV3RMSNorm
    finally:
        norms.sums_as_hf.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_decoded_row_is_normed_in_the_kernels_as_torch_norms_it(dtype: torch.dtype, monkeypatch) -> None:
    """One row takes one call of the kernels module: HF's norm to two rounding steps of the dtype (its
    float32 sum runs in another order; the normed value and its product with the weight each round),
    element by element, most elements equal in half precision; more rows stay in torch's fused op."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    from moeinf import _kernels

    hf = DeepseekV3RMSNorm(2048, eps=1e-6)
    hf.weight.data = torch.randn(2048, generator=torch.Generator().manual_seed(4))
    hf.to(dtype)
    fused = FusedRMSNorm(hf)
    calls = []
    original = _kernels.rms_norm
    monkeypatch.setattr(_kernels, "rms_norm", lambda *args: calls.append(args) or original(*args))
    rows = torch.randn(6, 1, 2048, generator=torch.Generator().manual_seed(5)).to(dtype) * 4
    for row in rows:
        got, want = fused(row), hf(row)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        step = want.abs() * {torch.bfloat16: 2**-6, torch.float16: 2**-9, torch.float32: 2**-20}[dtype]
        assert ((got.float() - want.float()).abs() <= step.float() + 1e-30).all()
        if dtype != torch.float32:  # float32 keeps the sum's last bits
            assert (got == want).float().mean() > 0.95
    assert len(calls) == len(rows)
    assert torch.equal(fused(rows.view(6, 2048)), hf(rows.view(6, 2048))) and len(calls) == len(rows)
