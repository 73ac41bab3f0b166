"""The public `MoE`: stats, refusals naming the knob, thread safety, lifetime."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from moeinf import ConfigError, MoE, OffloadConfig
from moeinf.store import Store, StoreError, pack
from moeinf.trace.eamc import EAMC, EAMCMismatchError


def prompts(seed: int, batch: int = 2, length: int = 6) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def olmoe(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    model_dir = tiny_model_dir("olmoe")
    store_dir = tmp_path_factory.mktemp("olmoe") / "store"
    pack(model_dir, store_dir, progress=False)
    return model_dir, store_dir


def test_stats_count_every_access_and_read(olmoe) -> None:
    model_dir, store_dir = olmoe
    config = OffloadConfig(offload_dir=str(store_dir), device_cache=0.25, prefetch="none", eviction="lru")
    with MoE(model_dir, config) as moe:
        moe.generate(prompts(0), max_new_tokens=8, do_sample=False)
        stats = moe.stats()
        blob = Store(store_dir).max_blob_size
        assert stats["accesses"] > 0
        assert stats["hits"] + stats["misses"] == stats["accesses"]
        # No prefetch: every read is a demand miss, and every tiny blob has the same size.
        assert stats["bytes_read"] == stats["misses"] * blob
        assert stats["prefetches"] == 0 and stats["prefetch_recall"] == 0.0
        assert stats["tokens"] == 2 * 8
        assert stats["stall_s"] >= 0.0
        moe.reset_stats()
        assert moe.stats()["accesses"] == 0 and moe.stats()["tokens"] == 0


def test_prefetch_stats_are_ratios(olmoe) -> None:
    model_dir, store_dir = olmoe
    with MoE(model_dir, OffloadConfig(offload_dir=str(store_dir), device_cache=0.3)) as moe:
        for seed in range(3):
            moe.generate(prompts(seed), max_new_tokens=6, do_sample=False)
        stats = moe.stats()
    assert stats["prefetches"] > 0
    assert 0.0 <= stats["prefetch_recall"] <= 1.0
    assert 0.0 <= stats["prefetch_precision"] <= 1.0
    assert stats["hits"] + stats["misses"] == stats["accesses"]


def test_refuses_a_budget_below_top_k_experts(olmoe) -> None:
    model_dir, store_dir = olmoe
    blob = Store(store_dir).max_blob_size
    with pytest.raises(ConfigError, match="device_cache"):
        MoE(model_dir, {"offload_dir": str(store_dir), "device_cache": blob})  # 1 expert < top_k = 2
    with MoE(model_dir, {"offload_dir": str(store_dir), "device_cache": 2 * blob}) as moe:
        moe.generate(prompts(1), max_new_tokens=2, do_sample=False)  # exactly top_k slots are enough


def test_refuses_the_store_of_another_model(olmoe, tiny_model_dir) -> None:
    _, store_dir = olmoe
    with pytest.raises(StoreError):
        MoE(tiny_model_dir("mixtral"), {"offload_dir": str(store_dir)})


def test_refuses_an_eamc_of_another_model(olmoe, tmp_path: Path) -> None:
    model_dir, store_dir = olmoe
    store = Store(store_dir)
    eams = np.ones((2, store.index.num_layers, store.index.num_experts), dtype=np.float32)
    path = EAMC(eams).save(tmp_path / "other.safetensors", {"fingerprint": "0" * 64})
    with pytest.raises(EAMCMismatchError, match="trace"):
        MoE(model_dir, {"offload_dir": str(store_dir), "eamc": str(path)})


def test_unknown_config_key_is_refused(olmoe) -> None:
    model_dir, store_dir = olmoe
    with pytest.raises(ConfigError, match="unknown"):
        MoE(model_dir, {"offload_dir": str(store_dir), "cache": "1GiB"})


@pytest.mark.parametrize(("field", "value", "message"), [
    ("io_threads", "2", "io_threads: must be an integer, got '2'"),
    ("lookahead_next_token_layers", 2.5, "lookahead_next_token_layers: must be an integer"),
    ("prefetch_min_probability", "0.3", "prefetch_min_probability: must be a number"),
    ("verify_checksums", 1, "verify_checksums: must be true or false"),
])
def test_a_config_value_of_the_wrong_type_is_one_clear_error(field: str, value: object, message: str) -> None:
    """A JSON config (bench llamacpp --moeinf-config, expert parallelism) can carry "2" for 2: the field is
    named, instead of a comparison failing inside a check."""
    with pytest.raises(ConfigError, match=message):
        OffloadConfig.from_dict({field: value})
    assert OffloadConfig.from_dict({"eps": 1, "io_threads": 2}).eps == 1  # an int is a number


def test_two_threads_share_one_model(olmoe) -> None:
    from transformers import AutoModelForCausalLM

    model_dir, store_dir = olmoe
    ref = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    inputs = [prompts(10 + i, batch=1, length=5 + i) for i in range(2)]
    with torch.inference_mode():
        expected = [ref.generate(ids, max_new_tokens=8, do_sample=False) for ids in inputs]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []
    with MoE(model_dir, {"offload_dir": str(store_dir), "device_cache": 0.2}) as moe:

        def work(i: int) -> None:
            try:
                for _ in range(2):
                    results[i] = moe.generate(inputs[i], max_new_tokens=8, do_sample=False)
            except BaseException as exc:  # re-raised in the main thread below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    for i in range(2):
        assert torch.equal(results[i], expected[i])


def test_closed_model_refuses_work(olmoe) -> None:
    model_dir, store_dir = olmoe
    moe = MoE(model_dir, {"offload_dir": str(store_dir)})
    moe.close()
    moe.close()
    with pytest.raises(ConfigError, match="closed"):
        moe.generate(prompts(0), max_new_tokens=1)


def test_default_offload_dir_is_packed_next_to_the_model(tiny_model_dir, tmp_path: Path) -> None:
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir("qwen2_moe"), model_dir)
    with MoE(model_dir) as moe:
        moe.generate(prompts(0), max_new_tokens=2, do_sample=False)
    assert (tmp_path / "model.moeinf" / "moeinf-store.json").is_file()


def test_padding_is_not_counted_and_stays_exact(olmoe) -> None:
    from transformers import AutoModelForCausalLM

    model_dir, store_dir = olmoe
    ids = prompts(5, batch=2, length=6)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding of the first row
    ids[0, :3] = 0
    ref = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with MoE(model_dir, {"offload_dir": str(store_dir), "device_cache": 0.25}) as moe:
        with torch.inference_mode():
            got = moe(ids, attention_mask=mask).logits
            want = ref(ids, attention_mask=mask).logits
        torch.testing.assert_close(got[1], want[1])
        torch.testing.assert_close(got[0, 3:], want[0, 3:])
        eams = moe._live().offloader.batch.eams  # [B, L, E]
        store = Store(store_dir)
        per_token = store.index.top_k * store.index.num_layers
        assert eams[0].sum() == 3 * per_token and eams[1].sum() == 6 * per_token


def test_a_dtype_other_than_the_store_is_refused(olmoe) -> None:
    model_dir, store_dir = olmoe
    with pytest.raises(ConfigError, match="dtype"):
        MoE(model_dir, {"offload_dir": str(store_dir), "dtype": "bfloat16"})


def test_keep_rows_keeps_the_surviving_sequences_eams(olmoe) -> None:
    model_dir, store_dir = olmoe
    with MoE(model_dir, {"offload_dir": str(store_dir)}) as moe:
        moe(prompts(7, batch=3))
        eams = moe._live().offloader.batch.eams.copy()
        moe.keep_rows([2, 0])
        kept = moe._live().offloader.batch.eams
        assert kept.shape[0] == 2
        assert (kept[0] == eams[2]).all() and (kept[1] == eams[0]).all()


@pytest.mark.parametrize("prefetch", ["hybrid", "none"])
def test_a_cache_that_holds_the_model_claims_it_all_once(olmoe, prefetch: str) -> None:
    """At 100% with a prefetching policy the first layer claims every expert (lowest priority) and no
    layer plans after that; with prefetch none only demanded experts are read."""
    model_dir, store_dir = olmoe
    config = OffloadConfig(offload_dir=str(store_dir), device_cache=1.0, prefetch=prefetch)
    with MoE(model_dir, config) as moe:
        runtime = moe._live()
        planned: list[int] = []
        plan = runtime.offloader._plan
        runtime.offloader._plan = lambda layer, ahead=None: planned.append(layer) or plan(layer, ahead)
        want = moe.generate(prompts(3), max_new_tokens=6, do_sample=False)
        cache, offloader = runtime.cache, runtime.offloader
        claimed = len(cache.resident) + len(cache.in_flight)
        everything = offloader.num_layers * offloader.num_experts
        if prefetch == "hybrid":
            assert claimed == everything and planned == []
        else:
            assert claimed == len(cache.resident) < everything
        cache.refresh()
        assert torch.equal(moe.generate(prompts(3), max_new_tokens=6, do_sample=False), want)


def test_a_misspelt_config_field_is_refused_with_the_field_it_looks_like() -> None:
    with pytest.raises(ConfigError, match=r"unknown OffloadConfig field\(s\) \['device_cach', 'zzz'\]; "
                                          r"'device_cach' \(did you mean 'device_cache'\?\); known fields"):
        OffloadConfig.from_dict({"device_cach": "25%", "zzz": 1})


@pytest.mark.parametrize("size", ["150%", "-5%"])
def test_a_percentage_outside_0_to_100_names_itself(size: str) -> None:
    with pytest.raises(ConfigError, match=rf"device_cache: a percentage .* 0-100%, got '{size}'"):
        OffloadConfig(device_cache=size)


def test_text_a_flat_list_or_floats_are_refused_saying_what_generate_takes(olmoe) -> None:
    model_dir, store_dir = olmoe
    with MoE(model_dir, {"offload_dir": str(store_dir), "device_cache": 0.5}) as moe:
        for given, named in (("hi", "got str"), ([1, 2], "got list"), (torch.tensor([1, 2]), "shape [2]"),
                             (torch.ones(1, 2), "a tensor of shape [1, 2] (float32)")):
            with pytest.raises(TypeError, match=r"MoE.generate takes input_ids, a \[batch, tokens\].*"
                                                + re.escape(named)):
                moe.generate(given, max_new_tokens=2)
            with pytest.raises(TypeError, match=r"MoE.__call__ takes input_ids"):
                moe(given)


def test_no_token_or_an_id_outside_the_vocabulary_is_one_value_error(olmoe) -> None:
    model_dir, store_dir = olmoe
    with MoE(model_dir, {"offload_dir": str(store_dir), "device_cache": 0.5}) as moe:
        size = moe.model.get_input_embeddings().num_embeddings
        with pytest.raises(ValueError, match=r"MoE.generate: input_ids holds no token \(shape \[1, 0\]\)"):
            moe.generate(torch.zeros((1, 0), dtype=torch.long), max_new_tokens=2)
        for bad in (size, -1):
            with pytest.raises(ValueError, match=rf"token id {bad} is outside the model's vocabulary of "
                                                 rf"{size} tokens \(ids 0 to {size - 1}\)"):
                moe.generate(torch.tensor([[1, bad]]), max_new_tokens=2)
            with pytest.raises(ValueError, match=rf"MoE.__call__: token id {bad}"):
                moe(torch.tensor([[bad]]))
        # the edges of the vocabulary are ids like any other
        assert moe.generate(torch.tensor([[0, size - 1]]), max_new_tokens=2, do_sample=False).shape == (1, 4)
