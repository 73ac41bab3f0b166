"""A quantised store's DeepSeek-V3 decoder layers decode one row as one flat function
(`moeinf.models.deepseek_v3.decode_layer`): the same logits, bit for bit, as the layers' own forward over
their replaced parts; the layer's own forward wherever the flat function would not do the same."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_mla_decode import decode_logits

from moeinf import MoE, OffloadConfig
from moeinf.models.deepseek_v3.decode_layer import OneRowDecode, flat_decode

VARIANTS = {
    # the e2e model's layout: one q projection, every group kept (the router in the kernels module)
    "q-proj": dict(hidden_size=128, q_lora_rank=None, n_group=1, topk_group=1),
    # DeepSeek-V3's own: a q LoRA with its norm, group-limited routing (the router's own forward)
    "q-lora": dict(hidden_size=128),
}


@pytest.fixture
def flat_calls(monkeypatch) -> list[OneRowDecode]:
    """The layers whose flat function ran, one entry per call."""
    calls: list[OneRowDecode] = []
    original = OneRowDecode.decode

    def counted(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(OneRowDecode, "decode", counted)
    return calls


def open_quantised(tiny_model_dir, tmp_path: Path, variant: str, quant: str, dtype: str = "bfloat16",
                   **config) -> MoE:
    model_dir = tiny_model_dir("deepseek_v3", dtype=dtype, **VARIANTS[variant])
    return MoE(model_dir, OffloadConfig(offload_dir=str(tmp_path / f"{variant}-{quant}-{dtype}"), quant=quant,
                                        **{"device_cache": "100%", **config}))


def count_products(monkeypatch) -> list[int]:
    """One entry per one-row product of a quantised linear that a flat decode step makes."""
    from moeinf import _kernels

    products: list[int] = []
    inside = [False]
    original_product, original_decode = _kernels.row_weight_product, OneRowDecode.decode

    def product(*args):
        if inside[0]:
            products.append(1)
        return original_product(*args)

    def decode(self, *args, **kwargs):
        inside[0] = True
        try:
            return original_decode(self, *args, **kwargs)
        finally:
            inside[0] = False

    monkeypatch.setattr(_kernels, "row_weight_product", product)
    monkeypatch.setattr(OneRowDecode, "decode", decode)
    return products


def own_forward(monkeypatch) -> None:
    """Every layer runs its own forward (the flat function is never bound)."""
    monkeypatch.setattr(OneRowDecode, "_bind", lambda *args: None)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize(("variant", "quant", "dtype"), [("q-proj", "int4", "bfloat16"),
                                                          ("q-proj", "int8", "float16"),
                                                          ("q-lora", "int8", "bfloat16"),
                                                          ("q-lora", "int4", "bfloat16")])
def test_flat_decode_steps_equal_the_layers_own_forward(variant: str, quant: str, dtype: str, padded: bool,
                                                         tiny_model_dir, tmp_path: Path, flat_calls,
                                                         monkeypatch) -> None:
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids) if padded else None
    products = count_products(monkeypatch)
    with open_quantised(tiny_model_dir, tmp_path, variant, quant, dtype) as moe:
        layers = [flat_decode(m) for m in moe.model.modules() if flat_decode(m) is not None]
        assert len(layers) == 2  # the MoE layers; the dense first layer keeps its own forward
        prefill, got = decode_logits(moe.model, ids, mask, steps=8)
        assert len(flat_calls) == 8 * len(layers)  # every decode step of every MoE layer, not the prefill
        # each projection once: the stacked first one (q or q_a, and the latent's), q_b with a LoRA, o
        assert len(products) == len(flat_calls) * (3 if variant == "q-lora" else 2)
        # the first q projection and the latent's took one product (their int8 weights stacked)
        assert all(layer._bound.first is not None for layer in layers)
        flat_calls.clear()
        with monkeypatch.context() as patch:
            own_forward(patch)
            want_prefill, want = decode_logits(moe.model, ids, mask, steps=8)
        assert not flat_calls
    assert torch.equal(prefill, want_prefill)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {step}"


def test_a_hooked_or_replaced_part_takes_the_layers_own_forward(tiny_model_dir, tmp_path: Path,
                                                                 flat_calls, monkeypatch) -> None:
    """A hook on any part would not run inside the flat function, and a replaced part is not what it bound:
    such a layer runs its own forward, and the flat function again once the hook is gone (rebound to the
    new part)."""
    from moeinf.kernels.quant_linear import QuantisedLinear
    from moeinf.store.quant import Quantization

    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    with open_quantised(tiny_model_dir, tmp_path, "q-proj", "int8") as moe:
        layers = [flat_decode(m) for m in moe.model.modules() if flat_decode(m) is not None]
        _, want = decode_logits(moe.model, ids, None, steps=3)
        seen = []
        handle = layers[0].layer.mlp.gate.register_forward_hook(lambda module, args, out: seen.append(out[2]))
        flat_calls.clear()
        _, got = decode_logits(moe.model, ids, None, steps=3)
        assert len(seen) == 1 + 3  # the prefill and every decode step ran the hooked router
        assert flat_calls == [layers[1]] * 3
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        handle.remove()
        attention = layers[1].layer.self_attn.inner
        bound = layers[1]._bound
        old = attention.o_proj
        replacement = QuantisedLinear(torch.nn.Linear(old.shape[1], old.shape[0], bias=False),
                                      Quantization.of("int8"), int8_activations=old.int8_activations)
        replacement.qweight, replacement.scales = old.qweight.clone(), old.scales.clone()
        attention.o_proj = replacement
        flat_calls.clear()
        _, again = decode_logits(moe.model, ids, None, steps=3)
        assert flat_calls == [layers[0], layers[1]] * 3
        assert layers[1]._bound is not bound  # bound again, to the new projection
        assert all(torch.equal(a, b) for a, b in zip(again, want, strict=True))
        # the stacked product's two linears keep views of its weights: nothing stored twice, and an in-place
        # write reaches both the layer's own forward and the flat function
        attention = layers[0].layer.self_attn.inner
        bound, stacked = layers[0]._bound, layers[0]._bound.first[0].qweight
        for linear in (attention.q_proj, attention.kv_a_proj_with_mqa):
            assert linear.qweight.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
        with torch.no_grad():  # outside inference mode, where the flat function was bound
            attention.kv_a_proj_with_mqa.qweight.copy_(attention.kv_a_proj_with_mqa.qweight.flip(0))
        _, flat = decode_logits(moe.model, ids, None, steps=3)
        assert layers[0]._bound is bound
        with monkeypatch.context() as patch:
            own_forward(patch)
            _, own = decode_logits(moe.model, ids, None, steps=3)
        assert all(torch.equal(a, b) for a, b in zip(flat, own, strict=True))
        assert not all(torch.equal(a, b) for a, b in zip(flat, want, strict=True))  # the write changed them


@pytest.mark.parametrize(("quant", "setting"), [("none", {}), ("int8", {"mla_absorb": False}),
                                                ("int8", {"fast_dense_modules": False})])
def test_only_quantised_stores_with_absorbed_mla_and_fused_modules_decode_flat(quant: str, setting: dict,
                                                                               tiny_model_dir,
                                                                               tmp_path: Path) -> None:
    with open_quantised(tiny_model_dir, tmp_path, "q-proj", quant, device_cache=0.5, **setting) as moe:
        assert not any(flat_decode(m) for m in moe.model.modules())


def test_the_look_ahead_keeps_its_routers_and_a_smaller_cache_decodes_flat(tiny_model_dir, tmp_path: Path,
                                                                            flat_calls, monkeypatch) -> None:
    """The look-ahead finds the routers by name before the layers are wrapped; with reads and plans (a cache
    of half the experts) the flat function still gives the tokens the layers' own forward gives."""
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(5))
    with open_quantised(tiny_model_dir, tmp_path, "q-proj", "int4", device_cache=0.5,
                        prefetch="hybrid") as moe:
        assert moe._live().offloader.lookahead.routers is not None
        with torch.inference_mode():
            got = moe.generate(ids, max_new_tokens=8, do_sample=False)
        assert flat_calls
        with monkeypatch.context() as patch:
            own_forward(patch)
            with torch.inference_mode():
                want = moe.generate(ids, max_new_tokens=8, do_sample=False)
        assert moe.stats()["reads"] > 0
    assert torch.equal(got, want)


def test_asked_for_hidden_states_the_layers_run_their_own_forward(tiny_model_dir, tmp_path: Path,
                                                                  flat_calls) -> None:
    """The module tree keeps its names. transformers records `output_hidden_states` with hooks, which it
    puts on the attentions and routers too (the parts): from then on the layers run their own forward, and
    the logits stay the flat function's."""
    from transformers import DynamicCache

    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(6))
    with open_quantised(tiny_model_dir, tmp_path, "q-proj", "int8") as moe, torch.inference_mode():
        model = moe.model
        names = {name for name, _ in model.named_modules()}
        assert "model.layers.1.mlp.experts" in names and not any(".inner.mlp" in name for name in names)
        logits = []
        for hidden in (False, True):
            cache = DynamicCache(config=model.config)
            token = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            flat_calls.clear()
            out = model(token, cache=cache, use_cache=True, output_hidden_states=hidden)
            assert len(flat_calls) == (0 if hidden else 2)
            logits.append(out.logits)
        assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert torch.equal(*logits)


def test_bound_under_inference_mode_the_flat_function_runs_outside_it(tiny_model_dir, tmp_path: Path,
                                                                      flat_calls) -> None:
    """Its buffers are normal tensors: a decode under `torch.no_grad` after one under inference mode writes
    them as before (an inference tensor would refuse the in-place writes outside inference mode)."""
    from transformers import DynamicCache

    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(7))
    with open_quantised(tiny_model_dir, tmp_path, "q-proj", "int4") as moe:
        model, logits = moe.model, []
        for mode in (torch.inference_mode, torch.no_grad):
            with mode():
                cache = DynamicCache(config=model.config)
                token = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
                logits.append([])
                for _ in range(3):
                    out = model(token, cache=cache, use_cache=True).logits
                    logits[-1].append(out)
                    token = out[:, -1:].argmax(-1)
        assert len(flat_calls) == 2 * 3 * 2
    assert all(torch.equal(a, b) for a, b in zip(*logits, strict=True))


@pytest.mark.parametrize("dense_kernel", ["auto", "weight-only"])
def test_attention_projections_left_unquantised_take_the_layers_own_forward(dense_kernel: str, tiny_model_dir,
                                                                          tmp_path: Path, flat_calls,
                                                                          monkeypatch) -> None:
    """`attention_linears` "model" keeps the projections as the model holds them, which the flat function
    does not bind: the layers decode with their own forward (it raised a KeyError at the first step)."""
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(8))
    with open_quantised(tiny_model_dir, tmp_path, "q-lora", "int4", attention_linears="model",
                        quant_dense_kernel=dense_kernel) as moe:
        _, got = decode_logits(moe.model, ids, None, steps=3)
        with monkeypatch.context() as patch:
            own_forward(patch)
            _, own = decode_logits(moe.model, ids, None, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(got, own, strict=True))
