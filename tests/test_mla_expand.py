"""MLA's expanded keys and values kept between steps (`moeinf.models.mla_expand`): bit-equal to HF's."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from moeinf import MoE, OffloadConfig
from moeinf.config import ConfigError
from moeinf.models.mla_expand import ExpandedKV, _rows_alone, _rows_paired, keep_expanded_kv
from tests.test_mla_decode import decode_logits


def hf_model(tiny_model_dir, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir("deepseek_v3"), dtype=dtype).eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("padded", [False, True])
def test_kept_expansions_give_hfs_logits_bit_for_bit(dtype: torch.dtype, padded: bool,
                                                     tiny_model_dir) -> None:
    ref = hf_model(tiny_model_dir, dtype)
    model = copy.deepcopy(ref)
    memos = keep_expanded_kv(model, 1 << 30)
    assert len(memos) == model.config.num_hidden_layers
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[0, :4] = 0
    want_prefill, want = decode_logits(ref, ids, mask, steps=12)
    got_prefill, got = decode_logits(model, ids, mask, steps=12)
    assert torch.equal(got_prefill, want_prefill)
    for step_got, step_want in zip(got, want, strict=True):
        assert torch.equal(step_got, step_want)
    # Every step after the prefill reused the rows before it (9 + 10 + ... + 20) where this CPU's GEMM gives
    # a row the bits it gives it alone; where it does not (float16 on some CPUs), HF's expansion ran.
    # (or, where only a one-row call differs, with the rows computed two or more at a time: `rows_paired`)
    weight = model.model.layers[0].self_attn.kv_b_proj.weight
    paired = torch.get_num_threads() == 1 and _rows_paired(weight)
    reused = sum(range(9, 21)) if _rows_alone(weight) or paired else 0
    assert all(memo.reused_rows == reused for memo in memos)


def latents(tokens: int, attention: torch.nn.Module, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    dtype = attention.kv_b_proj.weight.dtype
    kv_nope = torch.randn(2, 1, tokens, attention.kv_lora_rank, generator=generator).to(dtype)
    k_rot = torch.randn(2, 1, tokens, attention.qk_rope_head_dim, generator=generator).to(dtype)
    return kv_nope, k_rot


def assert_as_hf(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
        assert g.shape == w.shape and g.stride() == w.stride()


def test_a_changed_cache_is_expanded_again_from_its_first_changed_row(tiny_model_dir) -> None:
    attention = hf_model(tiny_model_dir, torch.bfloat16).model.layers[0].self_attn
    memo = ExpandedKV(attention, 1 << 30)
    kv_nope, k_rot = latents(10, attention, seed=1)
    assert_as_hf(memo(kv_nope, k_rot), attention.expand_kv(kv_nope, k_rot))
    assert memo.reused_rows == 0
    grown = tuple(torch.cat([t, u], dim=2) for t, u in zip((kv_nope, k_rot), latents(3, attention, seed=2),
                                                                   strict=True))
    grown[0][1, :, 6] += 1  # the second sequence's row 6 changed (a cache written in place)
    assert_as_hf(memo(*grown), attention.expand_kv(*grown))
    assert memo.reused_rows == 6
    cropped = tuple(t[:, :, :8].clone() for t in grown)  # a cache cropped to 8 rows, then reset
    assert_as_hf(memo(*cropped), attention.expand_kv(*cropped))
    assert memo.reused_rows == 6 + 8
    fresh = latents(8, attention, seed=3)
    assert_as_hf(memo(*fresh), attention.expand_kv(*fresh))
    assert memo.reused_rows == 6 + 8  # nothing in common: expanded from row 0


def test_where_one_row_calls_differ_a_new_row_is_expanded_beside_the_one_before(tiny_model_dir) -> None:
    # torch's CPU bf16 GEMM at one thread without AVX512_BF16: a one-row call runs a GEMV whose sums differ
    # from the same row's in a longer call, while rows of calls of two rows or more agree; a decode step
    # then computes its one new row with the row before it and keeps the second.
    # DeepSeek-V2-Lite's latent and head sizes: a tiny kv_b_proj's one-row call can agree with longer ones
    tiny = hf_model(tiny_model_dir, torch.bfloat16)
    config = copy.deepcopy(tiny.config)
    config.kv_lora_rank, config.num_attention_heads, config.num_key_value_heads = 512, 16, 16
    config.qk_nope_head_dim, config.v_head_dim, config.qk_rope_head_dim = 128, 128, 64
    config.qk_head_dim = 192
    attention = type(tiny.model.layers[0].self_attn)(config, layer_idx=0).to(torch.bfloat16).eval()
    with torch.no_grad():
        attention.kv_b_proj.weight.copy_(torch.randn(attention.kv_b_proj.weight.shape,
                                                     generator=torch.Generator().manual_seed(5)) * 0.05)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if not _rows_paired(attention.kv_b_proj.weight):
            pytest.skip("this CPU's bf16 GEMM gives a row other bits in a two-row call than in a long one")
        memo = ExpandedKV(attention, 1 << 30)
        memo.rows_alone, memo.rows_paired = False, True  # as on a CPU whose one-row calls differ
        kv_nope, k_rot = (t[:1] for t in latents(20, attention, seed=4))  # one sequence: one-row steps
        assert_as_hf(memo(kv_nope[:, :, :1], k_rot[:, :, :1]), attention.expand_kv(kv_nope[:, :, :1],
                                                                                    k_rot[:, :, :1]))
        assert memo.kept is None  # a one-row cache is HF's own one-row call
        for tokens in range(8, 21):
            rows = (kv_nope[:, :, :tokens], k_rot[:, :, :tokens])
            assert_as_hf(memo(*rows), attention.expand_kv(*rows))
        assert memo.reused_rows == sum(range(8, 20))
    finally:
        torch.set_num_threads(threads)


def test_a_cache_written_in_place_is_not_trusted_by_identity(tiny_model_dir) -> None:
    attention = hf_model(tiny_model_dir, torch.bfloat16).model.layers[0].self_attn
    memo = ExpandedKV(attention, 1 << 30)
    kv_nope, k_rot = latents(6, attention, seed=4)
    memo(kv_nope, k_rot)
    kv_nope[0, 0, 2, 0] = -kv_nope[0, 0, 2, 0]  # the same tensor, changed
    assert_as_hf(memo(kv_nope, k_rot), attention.expand_kv(kv_nope, k_rot))
    assert memo.reused_rows == 2


@pytest.mark.parametrize("case", ["float32", "over its share"])
def test_what_cannot_be_kept_runs_hfs_own_expand_kv(case: str, tiny_model_dir) -> None:
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    attention = hf_model(tiny_model_dir, dtype).model.layers[0].self_attn
    memo = ExpandedKV(attention, 100 if case == "over its share" else 1 << 30)
    for tokens in (5, 6):
        kv_nope, k_rot = latents(tokens, attention, seed=5)
        assert_as_hf(memo(kv_nope, k_rot), attention.expand_kv(kv_nope, k_rot))
        assert memo.kept is None and memo.reused_rows == 0


def test_a_weight_whose_rows_depend_on_each_other_is_never_kept(tiny_model_dir, monkeypatch) -> None:
    from moeinf.models import mla_expand

    attention = hf_model(tiny_model_dir, torch.bfloat16).model.layers[0].self_attn
    monkeypatch.setattr(mla_expand, "_rows_alone", lambda weight: False)
    memo = ExpandedKV(attention, 1 << 30)
    kv_nope, k_rot = latents(4, attention, seed=6)
    memo(kv_nope, k_rot)
    assert memo.kept is None and memo.rows_alone is False


@pytest.mark.parametrize(("quant", "max_bytes", "kept"), [("none", 1 << 30, True), ("none", 0, False),
                                                           ("int8", 1 << 30, False)])
def test_the_runtime_keeps_expansions_where_the_model_expands(quant: str, max_bytes: int, kept: bool,
                                                              tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("deepseek_v3", dtype="bfloat16")
    config = OffloadConfig(offload_dir=str(tmp_path / quant), quant=quant, device_cache=0.5,
                           mla_expanded_max_bytes=max_bytes)
    with MoE(model_dir, config) as moe:
        memos = [getattr(m, "expand_kv", None) for m in moe.model.modules()]
        memos = [memo for memo in memos if isinstance(memo, ExpandedKV)]
        assert bool(memos) == kept  # an int8 store's attention decodes absorbed, expanding nothing
        with torch.inference_mode():
            moe.generate(torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(1)),
                         max_new_tokens=4, do_sample=False)
        if kept:
            assert all(memo.reused_rows > 0 for memo in memos)


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ConfigError, match="mla_expanded_max_bytes"):
        OffloadConfig(mla_expanded_max_bytes=-1)
