"""ExpertCache on a scripted tier: capacity, protection, waves, demand priority, prefetch re-planning."""

from __future__ import annotations

import pytest
import torch

from moeinf.policy import EvictionContext, Key, make_eviction
from moeinf.runtime.cache import ExpertCache
from moeinf.runtime.stats import RuntimeStats
from moeinf.runtime.tiers import Tier

MAX = 1e9


class ScriptedTier(Tier):
    """Reads land only when `land()` is called (or when waited on); records every call."""

    name = "scripted"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.flight: dict[Key, float] = {}
        self.held: set[Key] = set()
        self.log: list[tuple[str, Key, float]] = []

    def submit(self, key: Key, priority: float) -> None:
        assert len(self.flight) + len(self.held) <= self.capacity or key in self.flight
        self.log.append(("submit", key, priority))
        if key not in self.held:
            self.flight[key] = priority

    def cancel(self, key: Key) -> bool:
        self.log.append(("cancel", key, 0.0))
        return self.flight.pop(key, None) is not None

    def land(self) -> None:
        self.held.update(self.flight)
        self.flight.clear()

    def is_resident(self, key: Key) -> bool:
        return key in self.held

    def wait(self, key: Key) -> dict[str, torch.Tensor]:
        if key in self.flight:
            del self.flight[key]
            self.held.add(key)
        assert key in self.held
        return {"w": torch.zeros(1)}

    def release(self, key: Key) -> None:
        self.log.append(("release", key, 0.0))
        self.held.remove(key)

    def close(self) -> None:
        pass


def make(capacity: int, policy: str = "lru", window: int | None = None
         ) -> tuple[ExpertCache, ScriptedTier, RuntimeStats]:
    tier, stats = ScriptedTier(capacity), RuntimeStats()
    cache = ExpertCache(tier, make_eviction(policy, 4, 8), stats, lambda key: 4096, MAX, window=window)
    return cache, tier, stats


def ctx(protected: frozenset[Key] = frozenset(), layer: int = 0) -> EvictionContext:
    return EvictionContext(cur_eam=None, layer=layer, protected=protected)


def test_a_layer_larger_than_the_tier_is_served_in_waves_within_capacity() -> None:
    cache, tier, stats = make(capacity=2)
    keys = [(0, e) for e in range(5)]
    served = [key for key, _ in cache.acquire(keys, lambda keep: ctx(keep))]
    assert sorted(served) == keys
    assert len(tier.held) + len(tier.flight) <= 2
    assert stats.misses["device"] == 5 and stats.reads == 5 and stats.bytes_read == 5 * 4096
    assert all(p == MAX for op, _, p in tier.log if op == "submit")


def test_resident_experts_are_served_first_and_counted_as_hits() -> None:
    cache, tier, stats = make(capacity=4)
    list(cache.acquire([(0, 1), (0, 2)], lambda keep: ctx(keep)))
    order = [key for key, _ in cache.acquire([(0, 3), (0, 2)], lambda keep: ctx(keep))]
    assert order == [(0, 2), (0, 3)]
    assert stats.hits["device"] == 1 and stats.accesses == 4


def test_prefetch_takes_the_best_ranked_and_never_evicts_protected() -> None:
    cache, tier, stats = make(capacity=3)
    list(cache.acquire([(0, 0), (0, 1)], lambda keep: ctx(keep)))
    protected = frozenset({(0, 0), (0, 1)})
    plan = [((1, 5), 0.9), ((1, 6), 0.5), ((2, 7), 0.1)]
    cache.prefetch(plan, ctx(protected))
    assert set(cache.in_flight) == {(1, 5)}  # capacity 3 - 2 protected = 1 wanted
    assert protected <= set(cache.resident)
    # A new plan re-prioritises what is in flight and cancels what it no longer wants.
    cache.prefetch([((1, 6), 0.8)], ctx(frozenset()))
    assert ("cancel", (1, 5), 0.0) in tier.log
    assert (1, 6) in cache.in_flight and (1, 5) not in cache.in_flight
    tier.land()
    list(cache.acquire([(1, 6)], lambda keep: ctx(keep, layer=1)))
    assert stats.useful_prefetches == 1 and stats.hits["device"] == 1


def test_a_demand_miss_on_a_queued_prefetch_is_raised_to_max_priority() -> None:
    cache, tier, _ = make(capacity=4)
    cache.prefetch([((1, 2), 0.3)], ctx())
    list(cache.acquire([(1, 2)], lambda keep: ctx(keep, layer=1)))
    assert ("submit", (1, 2), MAX) in tier.log


def test_one_refresh_starts_at_most_max_new_reads() -> None:
    cache, tier, stats = make(capacity=8, window=8)
    plan = [((1, e), 1.0 - e / 10) for e in range(6)]
    cache.prefetch(plan, ctx(), max_new=2)
    assert set(cache.in_flight) == {(1, 0), (1, 1)} and stats.prefetches == 2
    cache.prefetch(plan, ctx(), max_new=2)  # the next refresh continues down the plan
    assert set(cache.in_flight) == {(1, e) for e in range(4)}


def test_the_window_caps_unused_prefetches_of_layers_ahead() -> None:
    cache, tier, stats = make(capacity=8)  # window: a quarter of the tier
    assert cache.window == 2
    plan = [((2, e), 1.0 - e / 10) for e in range(6)]
    cache.prefetch(plan, ctx())
    assert set(cache.in_flight) == {(2, 0), (2, 1)}
    tier.land()
    cache.prefetch(plan, ctx(layer=1))  # still unused and ahead: nothing new may start
    assert stats.prefetches == 2
    list(cache.acquire([(2, 0)], lambda keep: ctx(keep, layer=2)))  # one is used: one more may start
    cache.prefetch([((3, 0), 0.9)], ctx(layer=2))
    assert (3, 0) in cache.in_flight and stats.prefetches == 3


def test_a_prefetch_never_evicts_an_unused_prefetch_of_a_layer_ahead() -> None:
    cache, tier, stats = make(capacity=4, window=4)
    list(cache.acquire([(0, 0), (0, 1)], lambda keep: ctx(keep)))
    cache.prefetch([((2, 0), 0.9), ((2, 1), 0.8)], ctx())
    tier.land()
    # A new plan no longer lists them, but they wait for layer 2: the cache evicts layer 0's experts.
    cache.prefetch([((3, 0), 0.9), ((3, 1), 0.8)], ctx(layer=1))
    tier.land()
    cache.refresh()
    assert {(2, 0), (2, 1), (3, 0), (3, 1)} == set(cache.resident)
    # A new forward pass: the unused ones become plain cache content and may go.
    cache.new_pass()
    assert not cache.prefetched
    cache.prefetch([((1, 0), 0.9)], ctx(layer=0))
    assert (1, 0) in cache.in_flight and len(cache.resident) == 3


class FailingTier(ScriptedTier):
    """A scripted tier whose reads of `broken` keys fail (`failures` more times; -1: always)."""

    def __init__(self, capacity: int, broken: set[Key], failures: int) -> None:
        super().__init__(capacity)
        self.broken, self.failures = broken, failures

    def wait(self, key: Key) -> dict[str, torch.Tensor]:
        if key in self.broken and self.failures != 0:
            self.failures -= 1
            self.flight.pop(key, None)  # a failed read lets go of the key (Tier.wait)
            raise OSError(f"short read of expert {key}")
        return super().wait(key)


def test_a_demand_claim_left_failed_by_an_earlier_request_is_read_again() -> None:
    tier, stats = FailingTier(4, {(0, 1)}, failures=1), RuntimeStats()
    cache = ExpertCache(tier, make_eviction("lru", 4, 8), stats, lambda key: 4096, MAX)
    cache._claim((0, 1), MAX)  # a request claimed it, then ended on another expert's error
    served = [key for key, _ in cache.acquire([(0, 1)], lambda keep: ctx(keep))]
    assert served == [(0, 1)]
    assert [entry for entry in tier.log if entry[0] == "submit"] == [("submit", (0, 1), MAX)] * 2
    # a read that fails for this request itself still reaches the caller, claim dropped
    tier.broken, tier.failures = {(0, 2)}, -1
    with pytest.raises(OSError, match="short read"):
        list(cache.acquire([(0, 2)], lambda keep: ctx(keep)))
    assert (0, 2) not in cache.in_flight


def test_resident_experts_come_in_one_wave_and_each_miss_in_its_own() -> None:
    """`acquire_waves` hands the keys already resident over together (one grouped compute), then the
    misses as they land."""
    cache, tier, _ = make(capacity=4)
    list(cache.acquire([(0, 0), (0, 1)], lambda keep: ctx(keep)))  # now resident
    keys = [(0, 2), (0, 0), (0, 3), (0, 1)]
    waves = [[key for key, _ in wave] for wave in cache.acquire_waves(keys, lambda keep: ctx(keep))]
    assert waves[0] == [(0, 0), (0, 1)]
    assert sorted(key for wave in waves[1:] for key in wave) == [(0, 2), (0, 3)]
    assert all(len(wave) >= 1 for wave in waves)
    assert len(tier.held) + len(tier.flight) <= 4


def test_demand_claims_the_misses_at_max_priority_before_a_prefetch_and_counts_them_once() -> None:
    """The runtime claims a layer's misses (`demand`) before it submits that layer's plan, so the engine
    queues the demand reads first; `acquire_waves(..., demanded)` then serves them without counting the
    accesses again."""
    cache, tier, stats = make(capacity=6, window=6)
    list(cache.acquire([(0, 0)], lambda keep: ctx(keep)))  # resident: a hit below
    cache.prefetch([((1, 4), 0.5)], ctx())  # queued earlier at a prefetch priority
    tier.log.clear()
    keys = [(1, 0), (1, 4), (0, 0)]
    demanded = cache.demand(keys, ctx(frozenset(keys), layer=1))
    cache.prefetch([((2, 1), 0.9), ((2, 2), 0.8)], ctx(frozenset(keys), layer=1))
    submits = [(key, p) for op, key, p in tier.log if op == "submit"]
    assert submits[:2] == [((1, 0), MAX), ((1, 4), MAX)]  # the miss claimed, the queued prefetch raised
    assert [p for _, p in submits[2:]] == [0.9, 0.8]
    assert demanded == {(1, 0), (1, 4)}
    served = sorted(key for wave in cache.acquire_waves(keys, lambda keep: ctx(keep, layer=1), demanded)
                    for key, _ in wave)
    assert served == sorted(keys)
    assert stats.accesses == 1 + 3 and stats.hits["device"] == 1  # (0, 0), resident
    assert stats.demand_reads == 1 + 1 and stats.demand_reads_by_layer == {0: 1, 1: 1}
    assert stats.useful_prefetches == 1 and stats.late_prefetches == 1  # (1, 4) was still in flight


def test_cancelled_and_evicted_unused_prefetches_are_counted() -> None:
    cache, tier, stats = make(capacity=3, window=3)
    cache.prefetch([((1, 0), 0.9), ((1, 1), 0.8)], ctx())
    cache.prefetch([((1, 0), 0.9)], ctx())  # (1, 1) no longer planned: cancelled before it landed
    assert stats.cancelled_prefetches == 1 and stats.unused_evictions == 0
    tier.land()
    cache.refresh()
    cache.new_pass()  # (1, 0) becomes plain cache content: its eviction is not an unused prefetch's
    cache.prefetch([((2, 0), 0.9), ((2, 1), 0.8)], ctx(layer=1))
    tier.land()
    cache.refresh()
    list(cache.acquire([(0, 5), (0, 6)], lambda keep: ctx(keep)))  # evicts what the tier holds
    assert stats.evictions == 2 and stats.unused_evictions == 1
    assert stats.late_prefetches == 0 and stats.useful_prefetches == 0


def test_prefetch_returns_the_keys_it_wanted_and_holds_says_whether_the_cache_has_them() -> None:
    cache, tier, _ = make(capacity=3, window=3)
    list(cache.acquire([(0, 0)], lambda keep: ctx(keep)))
    plan = [((1, 5), 0.9), ((1, 6), 0.5), ((2, 7), 0.1)]
    wanted = cache.prefetch(plan, ctx(frozenset({(0, 0)})), max_new=1)
    assert wanted == [(1, 5), (1, 6)]  # capacity 3 - 1 protected; (2, 7) does not fit
    assert cache.holds([(0, 0), (1, 5)])  # resident and in flight
    assert not cache.holds(wanted)  # (1, 6) was wanted but max_new stopped its read
    cache.prefetch(plan, ctx(frozenset({(0, 0)})), max_new=1)
    assert cache.holds(wanted)
