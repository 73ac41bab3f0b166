"""The offloaded model computes exactly what the unmodified HF model computes, for every tiny family."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from moeinf import MoE, OffloadConfig
from moeinf.hf.tiny import FAMILIES
from moeinf.store import Store
from moeinf.trace.eamc import EAMC

_REFERENCES: dict[Path, torch.nn.Module] = {}


def reference(model_dir: Path):
    """The unmodified `from_pretrained` model (loaded once per directory)."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    if model_dir not in _REFERENCES:
        auto = AutoModelForSeq2SeqLM if "switch" in model_dir.name else AutoModelForCausalLM
        _REFERENCES[model_dir] = auto.from_pretrained(model_dir).eval()
    return _REFERENCES[model_dir]


def prompts(seed: int = 0, batch: int = 2, length: int = 7) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model, ids: torch.Tensor, seq2seq: bool) -> torch.Tensor:
    with torch.inference_mode():
        if seq2seq:
            return model(ids, decoder_input_ids=torch.zeros((ids.shape[0], 3), dtype=torch.long)).logits
        return model(ids).logits


def check_exact(moe: MoE, ref, seq2seq: bool, seed: int = 0) -> None:
    ids = prompts(seed)
    kwargs = dict(max_new_tokens=16, do_sample=False)
    got = moe.generate(ids, **kwargs)
    with torch.inference_mode():
        want = ref.generate(ids, **kwargs)
    assert torch.equal(got, want)
    actual, expected = logits(moe, ids, seq2seq), logits(ref, ids, seq2seq)
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generate_matches_from_pretrained(family: str, tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir(family)
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache=0.2)
    with MoE(model_dir, config) as moe:
        check_exact(moe, reference(model_dir), family == "switch_transformers")
        stats = moe.stats()
        assert stats["misses"] > 0 and stats["evictions"] > 0  # the 20% cache really was too small


def random_eamc(store_dir: Path, path: Path, entries: int = 6) -> Path:
    store = Store(store_dir)
    rng = np.random.default_rng(0)
    eams = rng.integers(0, 3, size=(entries, store.index.num_layers, store.index.num_experts))
    return EAMC(eams.astype(np.float32)).save(path, {"fingerprint": store.fingerprint})


@pytest.fixture(scope="module")
def qwen3_store(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path, Path]:
    from moeinf.store import pack

    model_dir = tiny_model_dir("qwen3_moe")
    store_dir = tmp_path_factory.mktemp("qwen3-store") / "store"
    pack(model_dir, store_dir, progress=False)
    eamc = random_eamc(store_dir, store_dir.parent / "eamc.safetensors")
    return model_dir, store_dir, eamc


@pytest.mark.parametrize("prefetch", ["activation-aware", "topk", "traced-topk", "none"])
@pytest.mark.parametrize("eviction", ["activation-aware", "lru", "lfu", "neighbor"])
def test_every_policy_pair_is_exact(prefetch: str, eviction: str, qwen3_store) -> None:
    model_dir, store_dir, eamc = qwen3_store
    config = OffloadConfig(offload_dir=str(store_dir), device_cache=0.2, prefetch=prefetch, eviction=eviction,
                           eamc=str(eamc))
    with MoE(model_dir, config) as moe:
        ref = reference(model_dir)
        check_exact(moe, ref, False, seed=1)  # logits run after generate: a warm, policy-shaped cache
        if prefetch != "none":
            assert moe.stats()["prefetches"] > 0


def test_online_eamc_learns_from_scratch(qwen3_store) -> None:
    model_dir, store_dir, _ = qwen3_store
    with MoE(model_dir, OffloadConfig(offload_dir=str(store_dir), device_cache=0.2)) as moe:
        ref = reference(model_dir)
        check_exact(moe, ref, False, seed=3)
        assert moe.stats()["prefetches"] == 0  # nothing to predict from yet
        check_exact(moe, ref, False, seed=4)
        assert moe.stats()["prefetches"] > 0  # the first sequences seeded the EAMC
