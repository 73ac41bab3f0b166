"""An exact store's DeepSeek-V3 layers decode a row as one flat function of HF's ops
(`moeinf.models.deepseek_v3.decode_exact`): the unmodified HF model's logits, bit for bit, at every step;
the layer's own forward wherever the flat function would not compute what it computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_mla_decode import decode_logits

from moeinf import MoE, OffloadConfig
from moeinf.models.deepseek_v3 import decode_exact
from moeinf.models.deepseek_v3.decode_exact import ExactRowDecode, source_digest


@pytest.fixture
def flat_steps(monkeypatch) -> list[int]:
    """One entry per layer call that took the flat function."""
    calls: list[int] = []
    original = ExactRowDecode.decode

    def counted(self, *args):
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(ExactRowDecode, "decode", counted)
    return calls


def needs_replayed_transformers() -> None:
    if source_digest() not in decode_exact.REPLAYED_SOURCES:
        pytest.skip(f"this transformers' DeepSeek-V3 forwards (digest {source_digest()}) are not those the "
                    "flat function replays: check decode_exact.ExactRowDecode.decode against them and add "
                    "the digest")


def hf_logits(model_dir: Path, ids: torch.Tensor, mask: torch.Tensor | None, steps: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    return decode_logits(model, ids, mask, steps)


VARIANTS = {
    "group-limited": {},  # q LoRA, a dense first layer, HF's group-limited router
    "no-q-lora": {"q_lora_rank": None},
    "rotate-half": {"rope_interleave": False},
    "top8": {"n_routed_experts": 64, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_flat_steps_give_hfs_logits_bit_for_bit(variant: str, tiny_model_dir, tmp_path: Path,
                                                 flat_steps) -> None:
    needs_replayed_transformers()
    model_dir = tiny_model_dir("deepseek_v3", dtype="bfloat16", hidden_size=128, **VARIANTS[variant])
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(4))
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache="50%")
    with MoE(model_dir, config) as moe:
        layers = moe.model.model.layers
        assert all(isinstance(layer.__dict__.get("forward"), ExactRowDecode) for layer in layers)
        prefill, got = decode_logits(moe.model, ids, None, steps=8)
    assert len(flat_steps) == 8 * len(layers)  # every decode step of every layer, no prefill
    want_prefill, want = hf_logits(model_dir, ids, None, steps=8)
    assert torch.equal(prefill, want_prefill)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {step}"


def test_masks_and_hooks_take_the_layers_own_forward(tiny_model_dir, tmp_path: Path, flat_steps) -> None:
    needs_replayed_transformers()
    model_dir = tiny_model_dir("deepseek_v3", dtype="bfloat16", hidden_size=128)
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, 0] = 0  # left padding: the body builds a mask, which the flat function does not take
    with MoE(model_dir, OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache="100%")) as moe:
        _, padded = decode_logits(moe.model, ids, mask, steps=3)
        assert flat_steps == []
        seen: list[int] = []
        handle = moe.model.model.layers[1].self_attn.q_a_proj.register_forward_hook(
            lambda module, args, out: seen.append(1))
        _, hooked = decode_logits(moe.model, ids, None, steps=3)
        assert len(seen) == 4  # the prefill and every step ran the hooked part's call
        assert len(flat_steps) == 3 * 2  # the other two layers stayed flat
        handle.remove()
    _, want_padded = hf_logits(model_dir, ids, mask, steps=3)
    _, want = hf_logits(model_dir, ids, None, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(padded, want_padded, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(hooked, want, strict=True))


def test_a_replaced_part_is_used_at_the_next_step(tiny_model_dir, tmp_path: Path, flat_steps) -> None:
    """Parts are bound at a layer's first decoded row and bound again when one is replaced."""
    needs_replayed_transformers()
    model_dir = tiny_model_dir("deepseek_v3", dtype="bfloat16", hidden_size=128)
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(6))
    with MoE(model_dir, OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache="100%")) as moe:
        _, before = decode_logits(moe.model, ids, None, steps=2)
        attn = moe.model.model.layers[2].self_attn
        zero = torch.nn.Linear(attn.o_proj.in_features, attn.o_proj.out_features, bias=False,
                               dtype=torch.bfloat16)
        torch.nn.init.zeros_(zero.weight)
        attn.o_proj = zero  # the layer's attention now adds nothing
        _, after = decode_logits(moe.model, ids, None, steps=2)
        assert len(flat_steps) == 4 * 3
    assert not torch.equal(before[1], after[1])


def test_an_unknown_transformers_keeps_the_layers_own_forward(monkeypatch, tiny_model_dir,
                                                              tmp_path: Path) -> None:
    monkeypatch.setattr(decode_exact, "REPLAYED_SOURCES", set())
    model_dir = tiny_model_dir("deepseek_v3", dtype="bfloat16", hidden_size=128)
    with MoE(model_dir, OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache="100%")) as moe:
        assert not any(isinstance(layer.__dict__.get("forward"), ExactRowDecode)
                       for layer in moe.model.model.layers)


def test_quantised_stores_are_not_flattened_here(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("deepseek_v3", dtype="bfloat16", hidden_size=128)
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), quant="int8", device_cache="100%")
    with MoE(model_dir, config) as moe:
        assert not any(isinstance(layer.__dict__.get("forward"), ExactRowDecode)
                       for layer in moe.model.model.layers)


def test_without_one_thread_steps_no_step_changes_torchs_threads(monkeypatch, tiny_model_dir,
                                                                  tmp_path: Path) -> None:
    """`one_thread_steps=False`: HF's logits, and a decoded row never sets torch's thread count."""
    needs_replayed_transformers()
    model_dir = tiny_model_dir("deepseek_v3", dtype="bfloat16", hidden_size=128)
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(4))
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache="50%", one_thread_steps=False)
    with MoE(model_dir, config) as moe:
        assert "exact decoder layers as one flat function of HF's ops" in moe._runtime.patches
        set_to: list[int] = []
        monkeypatch.setattr(torch, "set_num_threads", set_to.append)
        prefill, got = decode_logits(moe.model, ids, None, steps=4)
        monkeypatch.undo()
    assert set_to == []
    want_prefill, want = hf_logits(model_dir, ids, None, steps=4)
    assert torch.equal(prefill, want_prefill)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {step}"
