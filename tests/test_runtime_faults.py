"""Faults at run time: a read error reaches the caller naming the expert and the file, the next request
retries the read, generation is exact again once the file is repaired, and no slot is lost; the device
tier promotes demand claims and never waits on the engine while holding its lock."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from waiting import until

from moeinf import MoE
from moeinf.engine import MAX_PRIORITY, Engine, EngineError
from moeinf.runtime.device import DeviceTier
from moeinf.runtime.tiers import HostTier
from moeinf.store import Store, pack

EXPERTS_FILE = "experts.bin"


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    model_dir = tiny_model_dir("qwen3_moe")
    store_dir = tmp_path_factory.mktemp("faults") / "store"
    pack(model_dir, store_dir, progress=False)
    return model_dir, store_dir


def prompt() -> torch.Tensor:
    return torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(7))


def engine_slots_match_claims(moe: MoE) -> None:
    """Every engine slot in use belongs to a key the runtime claims: none leaked, none double-counted."""
    runtime = moe._live()
    cache, tier = runtime.cache, runtime.cache.tier
    engine = tier.host.engine if isinstance(tier, DeviceTier) else tier.engine
    for key in list(cache.in_flight):  # let reads in flight land, so every claim is countable
        if tier.cancel(key):
            del cache.in_flight[key]
    cache.refresh()
    if isinstance(tier, DeviceTier):
        # a read its demand or prefetch worker started holds a host slot until it lands: let it land
        until(lambda: engine.stats()["slots_used"] == len(engine.resident()), "the host reads to land",
              poll=0.01)
        assert len(engine.resident()) <= tier.host.capacity
        # a copy worker holds a slot while it copies: let the copies in flight land before counting
        until(lambda: len(tier._free) + len(tier._slots) == tier.capacity, "the device tier's copies to land",
              poll=0.01)
        assert set(tier._slots) == set(cache.resident)
    else:
        stats = engine.stats()
        assert set(engine.resident()) == set(cache.resident)
        assert stats["slots_used"] == len(cache.resident) + len(cache.in_flight)


@pytest.mark.parametrize(("tiers", "prefetch"),
                         [("host", "none"), ("host", None), ("device stand-in", "none")])
def test_a_read_error_names_expert_and_file_is_retried_and_loses_no_slot(qwen3, tiers: str,
                                                                         prefetch: str | None) -> None:
    from transformers import AutoModelForCausalLM

    model_dir, store_dir = qwen3
    ids = prompt()
    with torch.inference_mode():
        want = AutoModelForCausalLM.from_pretrained(model_dir).eval().generate(
            ids, max_new_tokens=8, do_sample=False)
    path = store_dir / EXPERTS_FILE
    good = path.read_bytes()
    config: dict[str, object] = {"offload_dir": str(store_dir), "device_cache": 0.3}
    if prefetch is not None:  # None: the default policy, whose failed prefetches must be dropped too
        config["prefetch"] = prefetch
    if tiers != "host":
        config["host_cache"] = 0.5
    with MoE(model_dir, config) as moe:
        tier = moe._live().cache.tier
        engine_stats = (tier.host.engine if isinstance(tier, DeviceTier) else tier.engine).stats
        with open(path, "r+b") as f:
            f.truncate(len(good) // 2)  # every expert in the second half of the file: short reads
        for attempt in (1, 2):
            with pytest.raises(EngineError, match=r"\(layer \d+, expert \d+\).*short read") as info:
                moe.generate(ids, max_new_tokens=8, do_sample=False)
            assert str(path) in str(info.value)
            assert engine_stats()["failures"] >= attempt  # the second request read it again
            engine_slots_match_claims(moe)
        path.write_bytes(good)  # repaired
        assert torch.equal(moe.generate(ids, max_new_tokens=8, do_sample=False), want)
        engine_slots_match_claims(moe)


class LockCheckingEngine:
    """An engine whose blocking `wait` fails if the calling thread holds the device tier's lock."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.tier: DeviceTier | None = None
        self.violations: list[str] = []
        self.waits = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)

    def wait(self, layer: int, expert: int, timeout: float | None = None) -> memoryview:
        self.waits += 1
        if self.tier is not None and self.tier._cond._is_owned():
            self.violations.append(f"wait({layer}, {expert}) under the device tier's lock")
        return self._engine.wait(layer, expert, timeout)


def test_no_engine_wait_under_the_device_tier_lock(qwen3) -> None:
    _, store_dir = qwen3
    store = Store(store_dir)
    engine = LockCheckingEngine(Engine.from_store(store, 3))
    tier = DeviceTier(HostTier(engine, store, 3), store, 2, store.max_blob_size, torch.device("cpu"))
    engine.tier = tier
    try:
        keys = [(e.layer, e.expert) for e in store.index.experts][:12]
        for key in keys:  # every claim past the third evicts a host copy
            tier.submit(key, MAX_PRIORITY)
            tier.wait(key)
            tier.release(key)
        assert engine.waits >= len(keys) and engine.violations == []
    finally:
        tier.close()


def test_a_demand_claim_promotes_a_queued_or_copying_key_at_every_tier(qwen3) -> None:
    _, store_dir = qwen3
    store = Store(store_dir)
    engine = Engine.from_store(store, 4, paused=True)
    tier = DeviceTier(HostTier(engine, store, 4), store, 4, store.max_blob_size, torch.device("cpu"))
    try:
        a, b, c = (0, 0), (0, 1), (0, 2)
        tier.submit(a, 0.5)  # the "any" worker takes it and waits for its (paused) read
        with tier._cond:
            assert tier._cond.wait_for(lambda: a in tier._copying, timeout=30)
        tier.submit(b, 0.4)
        tier.submit(c, 0.3)  # queued in the device tier behind b
        assert engine.queued() == [a, b, c]
        tier.submit(c, MAX_PRIORITY)  # queued: the demand worker takes it, its read jumps the queue
        assert engine.queued()[0] == c
        tier.submit(a, MAX_PRIORITY)  # being copied: its read is raised too
        assert engine.queued()[:2] in ([c, a], [a, c])
        engine.resume()
        for key in (a, b, c):
            tier.wait(key)
        assert len(tier._free) == 1 and not tier._queued and not tier._copying
    finally:
        tier.close()


class GatedEngine(LockCheckingEngine):
    """Also holds `wait` of the keys in `gated` until `gate` is set (a read that takes forever)."""

    def __init__(self, engine: Engine, gated: set[tuple[int, int]]) -> None:
        super().__init__(engine)
        self.gated, self.gate = gated, threading.Event()

    def wait(self, layer: int, expert: int, timeout: float | None = None) -> memoryview:
        if (layer, expert) in self.gated:
            assert self.gate.wait(60)
        return super().wait(layer, expert, timeout)


def test_a_demand_is_not_held_up_by_a_prefetch_copy_waiting_for_its_read(qwen3) -> None:
    _, store_dir = qwen3
    store = Store(store_dir)
    slow, wanted = (0, 3), (0, 4)
    engine = GatedEngine(Engine.from_store(store, 4), {slow})
    tier = DeviceTier(HostTier(engine, store, 4), store, 4, store.max_blob_size, torch.device("cpu"))
    engine.tier = tier
    try:
        tier.submit(slow, 0.5)
        with tier._cond:
            assert tier._cond.wait_for(lambda: slow in tier._copying, timeout=30)
        tier.submit(wanted, MAX_PRIORITY)
        done = threading.Event()
        threading.Thread(target=lambda: (tier.wait(wanted), done.set()), daemon=True).start()
        assert done.wait(30), "the demand waited behind the prefetch's read"
        engine.gate.set()
        tier.wait(slow)
        assert engine.violations == []
    finally:
        engine.gate.set()
        tier.close()
