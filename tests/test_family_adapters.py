"""The families offloaded through an adapter (`moeinf.hf.adapters`): DBRX, JetMoE, Llama-4, LongCat-Flash.

Their exactness at every cache size and dtype is `tests/test_families.py::test_family_is_exact` (they are
supported, so it enumerates them). Here: `moeinf pack` reads the layouts their hub checkpoints use (what
`save_pretrained` writes: DBRX's [E*I, H] blocks, JetMoE's fused parallel experts beside its router and bias,
Llama-4's fused [E, H, 2I] experts, LongCat-Flash's per-expert tensors, and its fused runtime layout whose
gate_up_proj has rows for the zero-computation experts), each stored expert being that expert's bytes of the
model transformers loads; and the combines at top-k the tiny defaults do not route (Llama-4 past two experts
per token, where HF's sum over every expert is reproduced as such; JetMoE and LongCat-Flash at three).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moeinf.hf.tiny import save_tiny
from moeinf.spec import spec_for
from moeinf.store import Store, pack

HUB_FUSED = {
    "dbrx": ("transformer.blocks.0.ffn.experts.mlp.w1", (8 * 32, 64)),
    "jetmoe": ("model.layers.0.mlp.input_linear.weight", (8, 192, 64)),
    "llama4_text": ("model.layers.1.feed_forward.experts.gate_up_proj", (8, 64, 192)),
    "longcat_flash": ("model.layers.0.mlp.experts.0.gate_proj.weight", (32, 64)),
}
"""A tensor of each family's hub layout, as `save_pretrained` writes it, with its shape."""


def _expert_rows(model: torch.nn.Module, family: str) -> dict[tuple[int, str], torch.Tensor]:
    """(MoE layer, stored tensor name) -> the [E, ...] runtime tensor of the model transformers loaded."""
    import re

    spec = spec_for(model.config.model_type)
    num_experts = spec.num_experts(model.config)
    modules = [m for name, m in model.named_modules() if re.fullmatch(spec.experts_module, name)]
    out = {}
    for layer, module in enumerate(modules):
        for t in spec.tensors:
            param = module.get_parameter(t.name)
            rows = param.view(num_experts, -1, *param.shape[1:]) if t.stacked else param[:num_experts]
            out[layer, t.name] = rows
    return out


def _runtime_layout(hub: Path, out: Path) -> Path:
    """The model saved as transformers holds it at run time (fused tensors under runtime names)."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32)
    out.mkdir()
    shutil.copy(hub / "config.json", out / "config.json")
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
              out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("family", sorted(HUB_FUSED))
def test_pack_reads_the_hub_layout(family: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hub = save_tiny(family, tmp_path / "hub")
    key, shape = HUB_FUSED[family]
    with safe_open(hub / "model.safetensors", "pt") as f:
        assert tuple(f.get_slice(key).get_shape()) == shape
    model = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32)
    expected = _expert_rows(model, family)
    sources = [hub]
    if family == "longcat_flash":  # per-expert on the hub; fused with spare rows at run time
        sources.append(_runtime_layout(hub, tmp_path / "runtime"))
    for src in sources:
        pack(src, tmp_path / f"store-{src.name}", progress=False)
        store = Store(tmp_path / f"store-{src.name}")
        assert len(store.index.experts) == len({layer for layer, _ in expected}) * 8
        for entry in store.index.experts:
            stored = store.read_expert(entry.layer, entry.expert)
            for name, tensor in stored.items():
                assert torch.equal(tensor, expected[entry.layer, name][entry.expert]), (src.name, entry, name)
        dense = store.load_dense()
        under = [k for k in dense if k.startswith(tuple(m + "." for m in store.index.modules))]
        if family == "jetmoe":  # the MoE block's router and bias stay dense, and the attention experts
            assert "model.layers.0.mlp.bias" in dense and "model.layers.0.mlp.router.layer.weight" in dense
            assert "model.layers.0.self_attention.experts.input_linear.weight" in dense
            assert sorted({k.rsplit(".mlp.", 1)[1] for k in under}) == ["bias", "router.layer.weight"]
        else:
            assert not under, under  # every expert tensor went to the store


@pytest.mark.parametrize(("family", "top_k_attr", "top_k"), [
    ("llama4_text", "num_experts_per_tok", 2), ("llama4_text", "num_experts_per_tok", 3),
    ("jetmoe", "num_experts_per_tok", 3), ("longcat_flash", "moe_topk", 3),
])
def test_combines_beyond_the_tiny_top_k_are_exact(family: str, top_k_attr: str, top_k: int,
                                                  tmp_path: Path) -> None:
    """Llama-4's released models route one expert per token; two and three (HF's [E, T, H] sum kept
    as such) are exact too. JetMoE's one `index_add` of every expert's rows sums in float32 on CPU where
    LongCat's per-expert calls round after each expert: from three experts per token on, bf16 tells them
    apart (the tiny models route two; DBRX's routes four)."""
    from moeinf.bench.exact import (
        Case,
        batch_inputs,
        compare,
        forward_logits,
        greedy,
        random_eamc,
        reference_model,
    )
    from moeinf.config import OffloadConfig

    model_dir = save_tiny(family, tmp_path / "model", dtype="bfloat16", **{top_k_attr: top_k})
    pack(model_dir, tmp_path / "store", progress=False)
    reference = reference_model(model_dir, "bfloat16", False)
    inputs = batch_inputs(False)
    eamc = random_eamc(tmp_path / "store", tmp_path / "eamc.safetensors")
    case = Case(family, "bfloat16", model_dir, tmp_path / "store", eamc, reference, False, inputs,
                forward_logits(reference, inputs, False), greedy(reference.generate, inputs, 8))
    defaults = OffloadConfig()
    row = compare(case, "min", defaults.prefetch, defaults.eviction, 8)
    assert row["tokens_equal"] and row["logits_equal"], row


@pytest.mark.parametrize("family", sorted(HUB_FUSED))
def test_tracer_reads_the_routing_the_runtime_routes(family: str, tmp_path: Path) -> None:
    """`RouterTracer` on the unmodified model (Llama-4's and JetMoE's experts are not called with the
    routing: it is read from their routers; DBRX's get [B, T, H]; LongCat-Flash's zero-computation
    experts are no expert) counts, per layer and expert, the tokens the offloaded runtime counts."""
    from transformers import AutoModelForCausalLM

    from moeinf.api import MoE
    from moeinf.trace.router import RouterTracer

    model_dir = save_tiny(family, tmp_path / "model")
    prompt = torch.tensor([[5, 17, 42, 9, 77, 3, 64, 21, 8, 100, 33]])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with RouterTracer(model) as tracer, torch.no_grad():
        model(prompt)
    traced = tracer.eams()  # [1, L, E]
    moe = MoE(model_dir, dict(offload_dir=str(tmp_path / "store"), device_cache="100%"))
    try:
        moe(prompt)
        routed = moe._live().offloader.batch.eams
    finally:
        moe.close()
    assert traced.shape == routed.shape and traced.sum() > 0
    assert (traced == routed).all()


def test_expert_parallelism_refuses_an_adapter_family(tmp_path: Path) -> None:
    from moeinf.api import MoE
    from moeinf.parallel.ep import EPError, attach

    model_dir = save_tiny("dbrx", tmp_path / "model")
    moe = MoE(model_dir, dict(offload_dir=str(tmp_path / "store")))
    try:
        with pytest.raises(EPError, match="does not serve dbrx models"):
            attach(moe._live(), str(model_dir), moe.config)
    finally:
        moe.close()
