from __future__ import annotations

import numpy as np
import pytest
import torch

from moeinf.hf.tiny import FAMILIES
from moeinf.spec import spec_for
from moeinf.trace.router import RouterTracer, generated_lengths

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]]


def load(model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    task = spec_for(AutoConfig.from_pretrained(model_dir).model_type).task
    auto = AutoModelForSeq2SeqLM if task == "seq2seq-lm" else AutoModelForCausalLM
    return auto.from_pretrained(model_dir).eval()


def left_pad(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def forward_kwargs(model, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    kwargs = dict(input_ids=ids, attention_mask=mask)
    if model.config.is_encoder_decoder:
        kwargs["decoder_input_ids"] = torch.tensor([[0, 4, 9]] * ids.shape[0])
    return kwargs


def new_tokens(model, out: torch.Tensor, prompt_width: int) -> torch.Tensor:
    return out[:, 1:] if model.config.is_encoder_decoder else out[:, prompt_width:]


def hook_count(model) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_traced_logits_equal_untraced_and_counts(tiny_model_dir, family: str) -> None:
    model = load(tiny_model_dir(family))
    ids, mask = left_pad(PROMPTS)
    kwargs = forward_kwargs(model, ids, mask)
    with torch.no_grad():
        plain = model(**kwargs).logits
    before = hook_count(model)
    with RouterTracer(model) as tracer, torch.no_grad():
        traced = model(**kwargs).logits
        eams = tracer.eams()
    assert hook_count(model) == before
    assert torch.equal(plain, traced)
    spec = spec_for(model.config.model_type)
    assert tracer.num_layers >= 2 and eams.shape == (3, tracer.num_layers, spec.num_experts(model.config))
    per_layer = eams.sum(axis=2)  # [B, L]
    for b, prompt in enumerate(PROMPTS):
        if model.config.is_encoder_decoder:  # encoder layers see the prompt, decoder layers 3 tokens
            encoder = [n.startswith("encoder.") for n in tracer.module_names]
            expected = np.where(encoder, len(prompt), 3) * tracer.top_k
        else:
            expected = np.full(tracer.num_layers, len(prompt) * tracer.top_k)
        assert per_layer[b].tolist() == expected.tolist()
    assert (eams > 0).sum(axis=2).min() >= 1


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_padded_batch_equals_each_sequence_alone(tiny_model_dir, family: str) -> None:
    model = load(tiny_model_dir(family))
    ids, mask = left_pad(PROMPTS)
    with RouterTracer(model) as tracer, torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, eos_token_id=None)
        # Pick as EOS a generated token (not padding) that makes some sequences stop before others: the batch
        # keeps going after they finished, and those extra steps must be dropped from their EAMs.
        free = new_tokens(model, out, ids.shape[1])
        pad = model.config.pad_token_id
        eos, expected = next((tok, lens) for tok in free.reshape(-1).tolist() if tok != pad
                             for lens in [generated_lengths(free, tok)] if min(lens) < max(lens))
        tracer.reset()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, eos_token_id=eos)
        lengths = generated_lengths(new_tokens(model, out, ids.shape[1]), eos)
        assert lengths == expected
        batch = tracer.eams(lengths)
        for b, prompt in enumerate(PROMPTS):
            tracer.reset()
            alone = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)).long(),
                                   max_new_tokens=5, do_sample=False, eos_token_id=eos)
            alone_new = new_tokens(model, alone, len(prompt))
            assert generated_lengths(alone_new, eos) == [lengths[b]]
            np.testing.assert_array_equal(batch[b], tracer.eams()[0])


def test_sequence_steps_have_weights_and_real_tokens_only(tiny_model_dir) -> None:
    model = load(tiny_model_dir("qwen3_moe"))
    ids, mask = left_pad(PROMPTS)
    with RouterTracer(model) as tracer, torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, eos_token_id=None)
        steps = tracer.sequence_steps(1)
    assert len(steps) == 3  # prefill + 2 decode steps (the last token is never fed back)
    first_ids, first_weights = steps[0][0]
    assert first_ids.shape == (3, 2) and first_weights.shape == (3, 2)
    assert np.all(first_weights > 0) and np.all((first_ids >= 0) & (first_ids < 8))
    assert all(step[layer][0].shape == (1, 2) for step in steps[1:] for layer in step)


def test_generated_lengths() -> None:
    tokens = torch.tensor([[4, 2, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0]])
    assert generated_lengths(tokens, 2) == [2, 4, 1]
    assert generated_lengths(tokens, [7, 2]) == [2, 3, 1]
    assert generated_lengths(tokens, None) == [4, 4, 4]


def test_experts_outside_a_model_forward_is_an_error(tiny_model_dir) -> None:
    model = load(tiny_model_dir("qwen3_moe"))
    block = model.model.layers[0].mlp
    with RouterTracer(model), torch.no_grad(), pytest.raises(RuntimeError, match="outside a forward"):
        block(torch.zeros(1, 2, 64))
