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
