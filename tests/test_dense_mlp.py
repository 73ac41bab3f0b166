"""A gated MLP's gate and up products as one (`moeinf.models.gated_mlp`): bit-equal to HF's."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from moeinf import MoE, OffloadConfig
from moeinf.models.gated_mlp import ConcatGatedMLP, concat_gated_mlps
from tests.test_mla_decode import decode_logits


def hf_model(tiny_model_dir, family: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir(family), dtype=dtype).eval()


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen2_moe"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stacked_gate_and_up_give_hfs_logits_bit_for_bit(family: str, dtype: torch.dtype,
                                                         tiny_model_dir) -> None:
    ref = hf_model(tiny_model_dir, family, dtype)
    model = copy.deepcopy(ref)
    names = concat_gated_mlps(model)
    assert names
    many_rows = []
    for name in names:
        model.get_submodule(name).inner.register_forward_hook(lambda *_: many_rows.append(1))
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    want_prefill, want = decode_logits(ref, ids, None, steps=8)
    got_prefill, got = decode_logits(model, ids, None, steps=8)
    assert torch.equal(got_prefill, want_prefill)
    for step_got, step_want in zip(got, want, strict=True):
        assert torch.equal(step_got, step_want)
    assert len(many_rows) == len(names)  # only the prefill ran the three products


def test_the_halves_are_views_of_the_stacked_weight(tiny_model_dir) -> None:
    model = hf_model(tiny_model_dir, "deepseek_v3", torch.bfloat16)
    mlp = model.get_submodule(concat_gated_mlps(model)[0])
    assert isinstance(mlp, ConcatGatedMLP)
    storage = mlp.gate_up_weight.untyped_storage().data_ptr()
    for half in (mlp.inner.gate_proj, mlp.inner.up_proj):
        assert half.weight.untyped_storage().data_ptr() == storage
    x = torch.randn(3, 4, mlp.inner.gate_proj.in_features).to(torch.bfloat16)
    gate, up = mlp.inner.gate_proj(x), mlp.inner.up_proj(x)
    assert torch.equal(mlp(x), mlp.inner.down_proj(mlp.inner.act_fn(gate) * up))


def test_float32_mlps_are_left_as_they_are(tiny_model_dir) -> None:
    assert concat_gated_mlps(hf_model(tiny_model_dir, "deepseek_v3", torch.float32)) == []


@pytest.mark.parametrize(("quant", "fast", "stacked"), [("none", True, True), ("none", False, False),
                                                        ("int8", True, False)])
def test_the_runtime_stacks_an_exact_stores_gated_mlps(quant: str, fast: bool, stacked: bool, tiny_model_dir,
                                                       tmp_path: Path) -> None:
    config = OffloadConfig(offload_dir=str(tmp_path / quant), quant=quant, device_cache=0.5,
                           fast_dense_modules=fast)
    with MoE(tiny_model_dir("deepseek_v3", dtype="bfloat16"), config) as moe:
        assert any(isinstance(m, ConcatGatedMLP) for m in moe.model.modules()) == stacked
