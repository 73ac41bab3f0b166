"""A DeepSeek-V3 body's one-row decode steps skip the causal mask SDPA does not need there
(`moeinf.models.deepseek_v3.decode_body`): the same logits, bit for bit, as the body's own forward; the
body's own forward wherever the mask or the outputs could differ."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_mla_decode import decode_logits

from moeinf import MoE, OffloadConfig
from moeinf.models.deepseek_v3.decode_body import OneRowBody


@pytest.fixture
def fast_steps(monkeypatch) -> list[bool]:
    """Each call's verdict: True where the body took the one-row path."""
    verdicts: list[bool] = []
    original = OneRowBody.one_row

    def counted(self, *args):
        verdicts.append(original(self, *args))
        return verdicts[-1]

    monkeypatch.setattr(OneRowBody, "one_row", counted)
    return verdicts


def body_of(moe: MoE) -> torch.nn.Module:
    body = moe.model.model
    assert isinstance(body.__dict__.get("forward"), OneRowBody)
    return body


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("quant", ["none", "int4"])
def test_one_row_steps_equal_the_bodys_own_forward(quant: str, padded: bool, tiny_model_dir, tmp_path: Path,
                                                   fast_steps) -> None:
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids) if padded else None
    model_dir = tiny_model_dir("deepseek_v3", dtype="bfloat16", hidden_size=128)
    config = OffloadConfig(offload_dir=str(tmp_path / quant), quant=quant, device_cache="100%")
    with MoE(model_dir, config) as moe:
        body = body_of(moe)
        prefill, got = decode_logits(moe.model, ids, mask, steps=6)
        # the prefill and every step with a mask run the body's own forward
        assert fast_steps == [False] + [not padded] * 6
        flat = body.__dict__.pop("forward")
        want_prefill, want = decode_logits(moe.model, ids, mask, steps=6)
        body.forward = flat
    assert torch.equal(prefill, want_prefill)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {step}"


def test_the_skipped_mask_is_none_in_transformers_too(tiny_model_dir) -> None:
    """Where `one_row` holds, transformers' own mask construction gives None (a transformers release that
    built a mask there would fail here); with a padding mask or an eager attention it does not."""
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.masking_utils import create_causal_mask

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("deepseek_v3"), dtype=torch.float32).eval()
    body = model.model
    cache = DynamicCache(config=model.config)
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model(ids, cache=cache, use_cache=True)
        token = torch.tensor([[5]])
        embeds = body.embed_tokens(token)
        position = torch.tensor([[6]])
        rule = OneRowBody(body)
        assert rule.one_row(token, None, cache, None, True)
        assert create_causal_mask(config=body.config, inputs_embeds=embeds, attention_mask=None, cache=cache,
                                  position_ids=position) is None
        padding = torch.tensor([[0, 1, 1, 1, 1, 1, 1]])
        assert not rule.one_row(token, padding, cache, None, True)
        assert create_causal_mask(config=body.config, inputs_embeds=embeds, attention_mask=padding,
                                  cache=cache, position_ids=position) is not None
        body.config._attn_implementation = "eager"
        assert not rule.one_row(token, None, cache, None, True)
        assert create_causal_mask(config=body.config, inputs_embeds=embeds, attention_mask=None, cache=cache,
                                  position_ids=position) is not None


def test_hooks_hidden_states_and_batches_keep_the_bodys_behaviour(tiny_model_dir, tmp_path: Path,
                                                                  fast_steps) -> None:
    """Each module still runs through its `__call__` (hooks run); asked for hidden states, or given two
    rows, the body runs its own forward and returns what it returns."""
    from transformers import DynamicCache

    model_dir = tiny_model_dir("deepseek_v3", dtype="bfloat16", hidden_size=128)
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), quant="int8", device_cache="100%")
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(2))
    with MoE(model_dir, config) as moe, torch.inference_mode():
        model, body = moe.model, body_of(moe)
        seen = []
        handles = [module.register_forward_hook(lambda m, a, o: seen.append(m))
                   for module in (body.embed_tokens, body.rotary_emb, body.layers[1], body.norm)]
        cache = DynamicCache(config=model.config)
        token = model(ids[:1], cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        seen.clear()
        fast_steps.clear()
        model(token, cache=cache, use_cache=True)
        assert fast_steps == [True]
        assert seen == [body.embed_tokens, body.rotary_emb, body.layers[1], body.norm]
        for handle in handles:
            handle.remove()
        fast_steps.clear()
        out = model(token, cache=cache, use_cache=True, output_hidden_states=True)
        assert fast_steps == []  # a keyword beyond the six: the body's own forward
        assert len(out.hidden_states) == model.config.num_hidden_layers + 1
        batch = DynamicCache(config=model.config)
        tokens = model(ids, cache=batch, use_cache=True).logits[:, -1:].argmax(-1)
        fast_steps.clear()
        model(tokens, cache=batch, use_cache=True)
        assert fast_steps == [False]


def test_fast_dense_modules_off_keeps_the_bodys_own_forward(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("deepseek_v3", dtype="bfloat16", hidden_size=128)
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache="100%", fast_dense_modules=False)
    with MoE(model_dir, config) as moe:
        assert "forward" not in moe.model.model.__dict__
