"""Attention projections in float32 or int8 (`attention_linears`): what is replaced, when, and the result."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moeinf import MoE, OffloadConfig
from moeinf.config import ConfigError
from moeinf.kernels import bf16_rows
from moeinf.kernels.bf16_rows import RowLinear
from moeinf.kernels.quant_linear import QuantisedLinear
from moeinf.models.attention_linears import Float32Linear, replace_attention_linears, resolve


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_linear_is_the_float32_product_rounded_to_the_input_dtype(dtype: torch.dtype,
                                                                          bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 24, bias=bias).to(dtype)
    x = torch.randn(3, 5, 64, dtype=dtype)
    wide = Float32Linear(linear)
    got = wide(x)
    want = F.linear(x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float())
    assert got.dtype == dtype and got.shape == (3, 5, 24)
    assert torch.equal(got, want.to(dtype))
    assert wide.weight.dtype == torch.float32 and not wide.weight.requires_grad


class ToyAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(32, 16, bias=False)
        self.norm = nn.LayerNorm(32)


class ToyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = ToyAttention()
        self.mlp = nn.Linear(32, 32)


@pytest.mark.parametrize(("mode", "cls"), [("float32", Float32Linear), ("int8", QuantisedLinear)])
def test_only_half_precision_linears_of_attention_modules_are_replaced(mode: str, cls: type) -> None:
    model = nn.Sequential(ToyBlock(), ToyBlock()).to(torch.bfloat16)
    assert replace_attention_linears(model, "model") == []
    assert replace_attention_linears(model, mode) == ["0.self_attn.q_proj", "1.self_attn.q_proj"]
    assert all(type(block.self_attn.q_proj) is cls for block in model)
    assert all(type(block.mlp) is nn.Linear and block.mlp.weight.dtype == torch.bfloat16 for block in model)
    assert replace_attention_linears(nn.Sequential(ToyBlock()), mode) == []  # float32 model: left alone
    with pytest.raises(ValueError, match="attention_linears"):
        replace_attention_linears(model, "auto")


def test_auto_changes_attention_for_quantised_stores_only() -> None:
    assert resolve("auto", quantised=True) == "int8"
    assert resolve("auto", quantised=False) == "model"
    assert resolve("float32", quantised=False) == "float32"
    assert resolve("model", quantised=True) == "model"
    with pytest.raises(ConfigError, match="attention_linears"):
        OffloadConfig(attention_linears="bf16")


def attention_linears(model: nn.Module) -> set[str]:
    return {f"{name}.{child}" for name, module in model.named_modules()
            if type(module).__name__.endswith("Attention")
            for child, sub in module.named_children() if type(sub) is nn.Linear}


@pytest.mark.parametrize(("quant", "setting", "replaced"), [("int4", "auto", QuantisedLinear),
                                                            ("int4", "model", None),
                                                            ("int8", "float32", Float32Linear),
                                                            ("none", "auto", None),
                                                            ("none", "float32", Float32Linear),
                                                            ("none", "int8", QuantisedLinear)])
def test_the_runtime_replaces_attention_linears_as_configured(quant: str, setting: str, replaced: type | None,
                                                              tiny_model_dir, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir("deepseek_v3", dtype="bfloat16")
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        want = ref(ids).logits.float()
    # mla_absorb off: its wrapper moves the attention's linears under `inner` (tests/test_mla_decode.py)
    config = OffloadConfig(offload_dir=str(tmp_path / quant), quant=quant, attention_linears=setting,
                           quant_dense="none", device_cache=0.5, mla_absorb=False)
    with MoE(model_dir, config) as moe:
        modules = dict(moe.model.named_modules())
        with torch.inference_mode():
            got = moe(ids).logits.float()
    expected = attention_linears(ref)
    assert expected
    if replaced is None:  # the model's own product: an exact store's by `bf16_rows` where the CPU runs it
        kept = RowLinear if quant == "none" and bf16_rows.available() else nn.Linear
        assert all(type(modules[name]) is kept for name in expected)
    else:
        assert all(type(modules[name]) is replaced for name in expected)
    assert not any(isinstance(m, Float32Linear | QuantisedLinear) for name, m in modules.items()
                   if name not in expected)
    if quant == "none" and replaced is None:
        assert torch.equal(got, want)  # the exact default stays HF's
    else:
        error = (got - want).abs().max() / want.std()
        assert error < 0.25  # test_quant's int4 bf16 allowance (float32 may even come out equal)
