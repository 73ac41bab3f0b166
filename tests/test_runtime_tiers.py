"""Two tiers: a device tier fed from the host tier by a copy thread (a 2nd CPU tier stands in for a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeinf import ConfigError, MoE
from moeinf.runtime.device import DeviceTier
from moeinf.store import Store, pack


def prompts(seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def qwen2(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    model_dir = tiny_model_dir("qwen2_moe")
    store_dir = tmp_path_factory.mktemp("qwen2") / "store"
    pack(model_dir, store_dir, progress=False)
    return model_dir, store_dir


def test_device_tier_stand_in_is_exact_and_counts_per_tier(qwen2) -> None:
    from transformers import AutoModelForCausalLM

    model_dir, store_dir = qwen2
    ref = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    config = {"offload_dir": str(store_dir), "device_cache": 0.2, "host_cache": 0.4}
    with MoE(model_dir, config) as moe:
        assert isinstance(moe._live().cache.tier, DeviceTier)
        for seed in range(2):  # the second call run with prefetches from the online EAMC
            ids = prompts(seed)
            with torch.inference_mode():
                want = ref.generate(ids, max_new_tokens=16, do_sample=False)
            assert torch.equal(moe.generate(ids, max_new_tokens=16, do_sample=False), want)
            with torch.inference_mode():
                torch.testing.assert_close(moe(ids).logits, ref(ids).logits)
        stats = moe.stats()
    tiers = stats["hits_per_tier"], stats["misses_per_tier"]
    assert stats["hits"] + stats["misses"] == stats["accesses"]
    # A device miss is served by the host tier (a host hit) or by a disk read (a host miss).
    assert tiers[0]["host"] + tiers[1]["host"] == stats["misses"]
    assert tiers[0]["host"] > 0  # the host tier kept experts the device tier had evicted
    assert stats["device_copies"] >= stats["misses"]
    assert stats["bytes_read"] == stats["reads"] * Store(store_dir).max_blob_size


def test_host_tier_too_small_for_one_expert_is_refused(qwen2) -> None:
    model_dir, store_dir = qwen2
    with pytest.raises(ConfigError, match="host_cache"):
        MoE(model_dir, {"offload_dir": str(store_dir), "device_cache": 0.2, "host_cache": 100})


def test_cuda_is_refused_without_a_device(qwen2) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    model_dir, store_dir = qwen2
    with pytest.raises(ConfigError, match="device"):
        MoE(model_dir, {"offload_dir": str(store_dir), "device": "cuda", "host_cache": 0.5})


@pytest.mark.gpu
def test_cuda_device_tier_is_exact(qwen2) -> None:
    from transformers import AutoModelForCausalLM

    model_dir, store_dir = qwen2
    ref = AutoModelForCausalLM.from_pretrained(model_dir).eval().cuda()
    config = {"offload_dir": str(store_dir), "device": "cuda", "device_cache": 0.2, "host_cache": 0.4}
    with MoE(model_dir, config) as moe:
        ids = prompts(0).cuda()
        with torch.inference_mode():
            want = ref.generate(ids, max_new_tokens=16, do_sample=False)
        assert torch.equal(moe.generate(ids, max_new_tokens=16, do_sample=False), want)


def test_a_key_resubmitted_while_it_is_copied_takes_one_slot(qwen2) -> None:
    import time

    from moeinf.engine import MAX_PRIORITY, Engine
    from moeinf.runtime.tiers import HostTier

    _, store_dir = qwen2
    store = Store(store_dir)
    engine = Engine.from_store(store, 4, paused=True)
    tier = DeviceTier(HostTier(engine, store, 4), store, 2, store.max_blob_size, torch.device("cpu"))
    try:
        key = (0, 1)
        tier.submit(key, 0.5)
        deadline = time.monotonic() + 10
        while key not in tier._copying:  # a copy worker took the job and waits for the paused read
            assert time.monotonic() < deadline
            time.sleep(0.01)
        tier.submit(key, MAX_PRIORITY)  # a demand fetch raises a key that is being copied
        engine.resume()
        tier.wait(key)
        time.sleep(0.2)  # a second job for the key, had one been queued, would be copied by now
        assert not tier._queued and len(tier._free) == 1  # one slot for the key, the other free
    finally:
        tier.close()


def test_cpu_copier_copies_synchronously_with_complete_events() -> None:
    from moeinf.runtime.copier import Copier

    copier = Copier(torch.device("cpu"), [], 64)
    dst, src = torch.zeros(64, dtype=torch.uint8), torch.arange(48, dtype=torch.uint8)
    event = copier.copy(dst, src, copier.released())
    assert event is None and copier.done(event) and torch.equal(dst[:48], src)
    copier.use(event)
    copier.close()


@pytest.mark.gpu
def test_cuda_copier_reads_the_registered_pool_on_a_side_stream(qwen2) -> None:
    from moeinf.engine import Engine
    from moeinf.runtime.copier import Copier

    _, store_dir = qwen2
    store = Store(store_dir)
    with Engine.from_store(store, 2) as engine:
        assert engine.stats()["pool_locked"]
        copier = Copier(torch.device("cuda"), engine.regions(), store.max_blob_size)
        assert copier.pinned_source  # never from pageable memory
        src = torch.frombuffer(engine.wait(0, 0), dtype=torch.uint8)
        assert src.is_pinned()
        dst = torch.empty(store.max_blob_size, dtype=torch.uint8, device="cuda")
        event = copier.copy(dst, src, copier.released())
        copier.use(event)
        assert torch.equal(dst[: src.numel()].cpu(), src)
        copier.close()
