"""MLA attention's decode step on the latent cache, `kv_b_proj` absorbed (`moeinf.runtime.mla_decode`)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from moeinf import MoE, OffloadConfig
from moeinf.runtime.mla_decode import AbsorbedMLADecode, absorb_mla


def decode_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None,
                  steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill logits and the logits of `steps` greedy one-row decode steps (with `mask` grown by one)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(ids, attention_mask=mask, cache=cache, use_cache=True)
        prefill, steps_out = out.logits, []
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(token, attention_mask=mask, cache=cache, use_cache=True)
            steps_out.append(out.logits[:, -1])
            token = out.logits[:, -1:].argmax(-1)
    return prefill, steps_out


@pytest.mark.parametrize("padded", [False, True])
def test_absorbed_decode_steps_match_hfs_attention_and_prefill_is_hfs_own(padded: bool,
                                                                         tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir("deepseek_v3"), dtype=torch.float32).eval()
    model = copy.deepcopy(ref)
    names = absorb_mla(model)
    assert names and all(type(model.get_submodule(n)) is AbsorbedMLADecode for n in names)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = None
    if padded:  # left padding: the decode steps' mask is not None
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
    want_prefill, want = decode_logits(ref, ids, mask, steps=5)
    got_prefill, got = decode_logits(model, ids, mask, steps=5)
    assert torch.equal(got_prefill, want_prefill)  # prefill runs HF's own forward
    for step_got, step_want in zip(got, want, strict=True):
        # the same math in another order of sums (float32 over the latent instead of expanded keys)
        torch.testing.assert_close(step_got, step_want, rtol=1e-4, atol=1e-4)
        assert not torch.equal(step_got, step_want) or padded  # the absorbed path ran


def test_only_deepseek_v3_attention_is_absorbed(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen3_moe"))
    assert absorb_mla(model) == []


@pytest.mark.parametrize(("quant", "setting", "absorbed"), [("int8", True, True), ("int4", True, True),
                                                          ("int8", False, False), ("none", True, False)])
def test_the_runtime_absorbs_mla_for_quantised_stores_unless_turned_off(quant: str, setting: bool,
                                                                         absorbed: bool, tiny_model_dir,
                                                                         tmp_path: Path) -> None:
    model_dir = tiny_model_dir("deepseek_v3", dtype="bfloat16")
    config = OffloadConfig(offload_dir=str(tmp_path / quant), quant=quant, mla_absorb=setting,
                           device_cache=0.5)
    with MoE(model_dir, config) as moe:
        wrapped = [m for m in moe.model.modules() if isinstance(m, AbsorbedMLADecode)]
        assert bool(wrapped) == absorbed
        if absorbed:  # the absorbed weights are kv_b_proj's exact ones, the inner projections int8
            inner = wrapped[0].inner
            assert type(inner.kv_b_proj).__name__ == "QuantisedLinear"
            assert wrapped[0].w_uk.dtype == torch.float32
        with torch.inference_mode():
            tokens = moe.generate(torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(1)),
                                  max_new_tokens=4, do_sample=False)
        assert tokens.shape == (1, 10)
