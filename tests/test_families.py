"""Every MoE family of the installed transformers is offloaded exactly or refused with a reason.

The families are enumerated from transformers itself (`moeinf.hf.families.moe_model_types`), so a new
transformers release fails `test_every_moe_family_is_supported_or_refused` until each family it adds is
either supported (and then tested here for exactness) or refused in `moeinf.spec.REFUSED`.

Exactness, per supported family and dtype: a tiny checkpoint built from the family's own config class with
`AutoConfig.for_model(model_type, ...)` (`moeinf.hf.tiny.tiny_config`), saved with `save_pretrained` (the
hub layout: per-expert tensors, renamed modules) and packed; a batch of two prompts of unequal length gives
`torch.equal` logits and identical greedy tokens to `from_pretrained(dir, dtype=...)` at the smallest
cache, 30% and 100%.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeinf.hf.families import moe_model_types, status
from moeinf.spec import UnsupportedModelError, spec_for

NEW_TOKENS = 32
CACHES = ("min", "30%", "100%")
STATUS = {t: status(t) for t in moe_model_types()}
SUPPORTED = sorted(t for t, s in STATUS.items() if s.status == "supported")


def test_every_moe_family_is_supported_or_refused() -> None:
    neither = sorted(t for t, s in STATUS.items() if s.status == "unknown")
    assert not neither, (f"MoE families of this transformers that moeinf neither supports nor refuses: "
                         f"{neither}; support them (experts interface) or refuse them to moeinf.spec.REFUSED")
    for s in STATUS.values():
        if s.status == "refused":
            assert len(s.reason) > 20 and "\n" not in s.reason, s


def test_enumeration_sees_the_families_it_must() -> None:
    """The walk over transformers finds MoE families of every kind (interface, table, refused) and no dense
    model."""
    for model_type in ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "switch_transformers", "dbrx",
                       "jetmoe", "llama4", "qwen3_next", "jamba", "granitemoehybrid", "qwen3_vl_moe"):
        assert model_type in STATUS, model_type
    for dense in ("llama", "qwen3", "mistral", "gpt2", "t5"):
        assert dense not in STATUS, dense
    assert len(SUPPORTED) >= 25, SUPPORTED


def test_a_refusal_is_one_line_that_says_why() -> None:
    with pytest.raises(UnsupportedModelError, match=r"'doge' cannot be offloaded: .*no experts") as err:
        spec_for("doge")
    assert "\n" not in str(err.value)
    with pytest.raises(UnsupportedModelError, match=r"not a MoE family"):
        spec_for("llama")


def _prepare(model_type: str, dtype: str, root: Path):
    from moeinf.bench.exact import Case, batch_inputs, forward_logits, greedy, random_eamc, reference_model
    from moeinf.hf.tiny import save_tiny
    from moeinf.store import pack

    model_dir = save_tiny(model_type, root / "model", dtype=dtype)
    store_dir = root / "store"
    pack(model_dir, store_dir, progress=False)
    reference = reference_model(model_dir, dtype, False)
    inputs = batch_inputs(False)
    eamc = random_eamc(store_dir, root / "eamc.safetensors")
    return Case(model_type, dtype, model_dir, store_dir, eamc, reference, False, inputs,
                forward_logits(reference, inputs, False), greedy(reference.generate, inputs, NEW_TOKENS))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("model_type", SUPPORTED)
def test_family_is_exact(model_type: str, dtype: str, tmp_path: Path) -> None:
    from moeinf.bench.exact import compare
    from moeinf.config import OffloadConfig

    if spec_for(model_type).task == "seq2seq-lm":
        pytest.skip(f"{model_type} is an encoder-decoder: tests/test_runtime_exact.py covers it")
    case = _prepare(model_type, dtype, tmp_path)
    defaults = OffloadConfig()
    rows = [compare(case, cache, defaults.prefetch, defaults.eviction, NEW_TOKENS) for cache in CACHES]
    for row in rows:
        assert row["tokens_equal"] and row["logits_equal"], row  # torch.equal, not allclose
    assert rows[0]["misses"] > 0  # the smallest cache really fetched on demand


def _runtime_layout(hub_dir: Path, out: Path) -> Path:
    """The same weights saved as transformers holds them at run time: fused [E, ...] experts tensors under
    the runtime module names (what a checkpoint saved without reverting the conversion looks like)."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoConfig

    auto = spec_for(AutoConfig.from_pretrained(hub_dir).model_type).auto_class()
    model = auto.from_pretrained(hub_dir, dtype=torch.float32)
    out.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(hub_dir / name, out / name)
    state = {key: value.detach().clone().contiguous() for key, value in model.state_dict().items()}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "granitemoe", "phimoe", "gpt_oss", "jamba",
                                        "lfm2_moe", "hy_v3", "qwen3_vl_moe"])
def test_pack_reads_hub_and_runtime_layouts_alike(model_type: str, tmp_path: Path) -> None:
    """`save_pretrained` writes the hub layout (Mixtral's block_sparse_moe.experts.N.w1, Qwen's per-expert
    gate/up/down, Granite's fused input_linear, LFM2's feed_forward.experts.N.w1, GPT-OSS's fused experts
    with biases, Qwen3-VL-MoE's fused experts each stored transposed); the packer reads it through
    transformers' conversion mapping and stores exactly what it stores from the fused runtime layout."""
    from safetensors import safe_open

    from moeinf.hf.tiny import save_tiny
    from moeinf.store import Store, pack

    hub = save_tiny(model_type, tmp_path / "hub")
    runtime = _runtime_layout(hub, tmp_path / "runtime")
    with safe_open(hub / "model.safetensors", "pt") as f:
        hub_keys = set(f.keys())
    with safe_open(runtime / "model.safetensors", "pt") as f:
        # gpt-oss's hub layout is fused already; Qwen3-VL-MoE's is fused with each expert transposed
        assert (hub_keys == set(f.keys())) == (model_type in ("gpt_oss", "qwen3_vl_moe"))
    for src in (hub, runtime):
        pack(src, tmp_path / f"store-{src.name}", progress=False)
    a, b = Store(tmp_path / "store-hub"), Store(tmp_path / "store-runtime")
    assert len(a.index.experts) == len(b.index.experts) > 0
    for entry in a.index.experts:
        left, right = a.read_expert(entry.layer, entry.expert), b.read_expert(entry.layer, entry.expert)
        assert left.keys() == right.keys()
        assert all(torch.equal(left[k], right[k]) for k in left)
    dense_a, dense_b = a.load_dense(), b.load_dense()
    assert set(dense_a) ^ set(dense_b) <= {"lm_head.weight"}  # a tied output embedding, saved or not
    assert all(torch.equal(dense_a[k], dense_b[k]) for k in set(dense_a) & set(dense_b))


def test_pack_undoes_transformers_block_conversions_as_transformers_does() -> None:
    """The packer's in-place grid transpose of one expert's bytes gives what transformers' Transpose(1, 2)
    and Interleave(dim=1) give for that expert (the grids `source._experts_transpose` declares)."""
    from transformers.core_model_loading import Interleave, Transpose

    from moeinf.store.pack import _transpose

    stored = torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # [E, a, b]
    cases = [(Transpose(1, 2), (6, 4)), (Interleave(dim=1), (3, 2))]  # grids of numbers; of rows of 4
    for op, grid in cases:
        want = next(iter(op.convert({"w": stored}, ["w"], ["w"]).values()))
        for e in range(stored.shape[0]):
            data = bytearray(stored[e].contiguous().view(torch.uint8).numpy().tobytes())
            _transpose(memoryview(data), grid)
            got = torch.frombuffer(data, dtype=torch.bfloat16).reshape(want.shape[1:])
            assert torch.equal(got, want[e]), type(op).__name__
