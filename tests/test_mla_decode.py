"""MLA attention's decode step on the latent cache, `kv_b_proj` absorbed
(`moeinf.models.deepseek_v3.mla_decode`)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from moeinf import MoE, OffloadConfig
from moeinf.models.deepseek_v3.mla_decode import AbsorbedMLADecode, absorb_mla


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


def prepared(dtype: torch.dtype, interleave: bool, tiny_model_dir) -> tuple[torch.nn.Module, torch.nn.Module]:
    """HF's tiny DeepSeek-V3 in `dtype` (rotary layout per `interleave`) and a copy whose norms are fused and
    whose MLA is absorbed, as the runtime prepares a quantised store's model."""
    from transformers import AutoModelForCausalLM

    from moeinf.kernels.norms import replace_norms

    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir("deepseek_v3", rope_interleave=interleave),
                                               dtype=dtype).eval()
    model = copy.deepcopy(ref)
    replace_norms(model)
    absorb_mla(model)
    return ref, model


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_one_row_decodes_in_the_kernels_as_in_torch_ops(dtype: torch.dtype, interleave: bool, tiny_model_dir,
                                                        monkeypatch) -> None:
    """A batch of one row takes the two kernel calls; they compute what the absorbed torch ops compute (the
    rotation and norm rounded as HF rounds, the attention's float32 sums in another order) and HF's
    attention within the absorbed path's tolerance. Every step of a growing cache, with and without a
    (boolean) mask."""
    ref, model = prepared(dtype, interleave, tiny_model_dir)
    attention = [m for m in model.modules() if isinstance(m, AbsorbedMLADecode)]
    calls = []
    original = AbsorbedMLADecode.decode_in_kernels

    def counted(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(AbsorbedMLADecode, "decode_in_kernels", counted)
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(2))
    for mask in (None, torch.ones_like(ids)):
        _, kernels = decode_logits(model, ids, mask, steps=6)
        assert len(calls) == 6 * len(attention)
        calls.clear()
        with monkeypatch.context() as torch_ops:
            torch_ops.setattr(AbsorbedMLADecode, "one_call", lambda *args: False)
            _, ops = decode_logits(model, ids, mask, steps=6)
        assert not calls
        _, want = decode_logits(ref, ids, mask, steps=6)
        tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
        for got, same_math, hf in zip(kernels, ops, want, strict=True):
            torch.testing.assert_close(got, same_math, rtol=tolerance, atol=tolerance)
            torch.testing.assert_close(got.float(), hf.float(), rtol=4 * tolerance, atol=4 * tolerance)


@pytest.mark.parametrize("interleave", [True, False])
def test_the_kernels_rotate_and_norm_as_hf_does(interleave: bool, tiny_model_dir) -> None:
    """mla_prepare's rotated query and key are HF's bit for bit (each op rounded to bf16 as HF's are), its
    normed latent the fused norm's to one bf16 step (float32 sums in another order)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )

    from moeinf import _kernels
    from moeinf.kernels.gemv import DTYPES

    _, model = prepared(torch.bfloat16, interleave, tiny_model_dir)
    wrapped = next(m for m in model.modules() if isinstance(m, AbsorbedMLADecode))
    attn, heads, nope, rope = wrapped.inner, wrapped.heads, wrapped.nope, wrapped.rope
    rank = attn.kv_lora_rank
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(1, heads, 1, nope + rope, generator=generator).bfloat16()
    latent = torch.randn(1, 1, rank + rope, generator=generator).bfloat16()
    angles = torch.rand(rope // 2, generator=generator) * 6
    cos, sin = (torch.cat([f(angles), f(angles)]).bfloat16().view(1, 1, rope) for f in (torch.cos, torch.sin))
    q_out = torch.empty(heads, nope + rope)
    kv, k_rot = torch.empty(rank, dtype=torch.bfloat16), torch.empty(rope, dtype=torch.bfloat16)
    norm = attn.kv_a_layernorm
    _kernels.mla_prepare(q.data_ptr(), latent.data_ptr(), norm.weight.data_ptr(), norm.eps, cos.data_ptr(),
                         sin.data_ptr(), interleave, DTYPES[torch.bfloat16],
                         _kernels.MlaShape(heads, nope, rope, rank, wrapped.v_dim), q_out.data_ptr(),
                         kv.data_ptr(), k_rot.data_ptr())
    rotate = apply_rotary_pos_emb_interleave if interleave else apply_rotary_pos_emb
    q_rot, k_want = rotate(q[..., nope:], latent[..., rank:].view(1, 1, 1, rope), cos, sin)
    assert torch.equal(q_out[:, nope:].bfloat16(), q_rot.view(heads, rope))
    assert torch.equal(q_out[:, :nope], q[..., :nope].float().view(heads, nope))
    assert torch.equal(k_rot, k_want.view(rope))
    normed = norm(latent[..., :rank]).view(rank)
    torch.testing.assert_close(kv, normed, rtol=2**-7, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "nope", "rope", "rank", "v_dim", "tokens"),
                         [(2, 5, 6, 20, 5, 7), (3, 16, 16, 64, 32, 41)])
def test_the_kernels_attend_over_the_latent_cache_as_the_absorbed_math_says(
        dtype: torch.dtype, heads: int, nope: int, rope: int, rank: int, v_dim: int, tokens: int) -> None:
    """mla_attend (vector steps where the CPU has AVX2; sizes that are and are not multiples of eight) against
    the absorbed attention in float64: scores from the rotated and latent halves, softmax over the unmasked
    tokens, values through W_uv; float32 sums, rounded once to the dtype."""
    from moeinf import _kernels
    from moeinf.kernels.gemv import DTYPES

    generator = torch.Generator().manual_seed(tokens)
    q = torch.randn(heads, nope + rope, generator=generator)
    latents = torch.randn(tokens, rank, generator=generator).to(dtype)
    keys = torch.randn(tokens, rope, generator=generator).to(dtype)
    w_uk = torch.randn(heads, nope, rank, generator=generator) / 4
    w_uv_t = torch.randn(heads, rank, v_dim, generator=generator) / 4
    mask = (torch.rand(tokens, generator=generator) > 0.3).to(torch.uint8)
    mask[0] = 1
    out = torch.empty(heads, v_dim, dtype=dtype)
    _kernels.mla_attend(q.data_ptr(), latents.data_ptr(), keys.data_ptr(), tokens, w_uk.data_ptr(),
                        w_uv_t.data_ptr(), 0.3, mask.data_ptr(), DTYPES[dtype],
                        _kernels.MlaShape(heads, nope, rope, rank, v_dim), out.data_ptr())
    q64, lat, k = q.double(), latents.double(), keys.double()
    q_latent = torch.einsum("hn,hnr->hr", q64[:, :nope], w_uk.double())
    scores = (q_latent @ lat.T + q64[:, nope:] @ k.T) * 0.3  # [h, T]
    scores = scores.masked_fill(mask == 0, float("-inf")).softmax(dim=-1)
    want = torch.einsum("hr,hrv->hv", scores @ lat, w_uv_t.double())
    step = {torch.float32: 2**-18, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(out.double(), want.to(dtype).double(), rtol=2 * step, atol=2 * step)
