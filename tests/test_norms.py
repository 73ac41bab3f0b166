"""RMSNorms in torch's fused kernel for quantised stores (moeinf/runtime/norms.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from moeinf import MoE, OffloadConfig
from moeinf.runtime.norms import FusedRMSNorm, replace_norms


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
    model_dir = tiny_model_dir("deepseek_v3", dtype="bfloat16")
    counts = {}
    for quant, fast in (("none", True), ("int8", True), ("int8", False)):
        config = OffloadConfig(offload_dir=str(tmp_path / quant), quant=quant, fast_dense_modules=fast)
        with MoE(model_dir, config) as moe:
            counts[quant, fast] = sum(isinstance(m, FusedRMSNorm) for m in moe.model.modules())
    assert counts["int8", True] > 0 and counts["none", True] == 0 and counts["int8", False] == 0


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
