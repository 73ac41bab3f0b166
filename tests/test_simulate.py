from __future__ import annotations

import math
from functools import cache
from itertools import combinations

import numpy as np
import pytest

from moeinf.config import EVICTION_POLICIES
from moeinf.policy import EvictionContext, PolicyError, make_eviction, make_prefetch
from moeinf.policy.simulate import NearestEAM, bandwidth_in_experts, eams_of, simulate
from moeinf.policy.synthetic import SyntheticModel

ALL_EVICTIONS = (*EVICTION_POLICIES, "oracle")


def trace_of(steps: list[list[set[int]]], num_experts: int) -> np.ndarray:
    """steps[s][l] = the experts layer l uses at step s -> an [S, L, E] count array."""
    trace = np.zeros((len(steps), len(steps[0]), num_experts), dtype=np.int32)
    for s, layers in enumerate(steps):
        for layer, experts in enumerate(layers):
            trace[s, layer, sorted(experts)] = 1
    return trace


def min_misses(traces: list[np.ndarray], capacity: int) -> int:
    """Exhaustive search over every eviction choice: the fewest misses any demand cache can get."""
    visits = [frozenset((layer, int(e)) for e in np.flatnonzero(step[layer]))
              for trace in traces for step in trace for layer in range(trace.shape[1])]

    @cache
    def best(t: int, resident: frozenset) -> int:
        if t == len(visits):
            return 0
        need = visits[t]
        missing = len(need - resident)
        together = resident | need
        over = len(together) - capacity
        if over <= 0:
            return missing + best(t + 1, together)
        return missing + min(best(t + 1, together - set(drop))
                             for drop in combinations(sorted(resident - need), over))

    return best(0, frozenset())


def test_lru_and_oracle_on_a_hand_trace():
    trace = trace_of([[{0}], [{1}], [{0}], [{2}], [{1}]], 4)
    lru = simulate([trace], 2, make_eviction("lru", 1, 4))
    assert (lru.hits, lru.misses) == (1, 4)  # 2 evicts 1, then 1 evicts 0
    oracle = simulate([trace], 2, make_eviction("oracle", 1, 4, allow_oracle=True))
    assert (oracle.hits, oracle.misses) == (2, 3)  # 2 evicts 0 (never used again)
    assert oracle.hit_ratio == pytest.approx(2 / 5)


@pytest.mark.parametrize("seed", range(12))
def test_belady_is_optimal_and_beats_every_policy(seed):
    rng = np.random.default_rng(seed)
    num_layers, num_experts, top_k = 2, 3, int(rng.integers(1, 3))
    traces = []
    for _ in range(2):
        steps = int(rng.integers(2, 4))
        routed = np.zeros((steps, num_layers, num_experts), dtype=np.int32)
        for s in range(steps):
            for layer in range(num_layers):
                routed[s, layer, rng.choice(num_experts, size=top_k, replace=False)] = 1
        traces.append(routed)
    for capacity in range(top_k, num_layers * num_experts):
        belady = make_eviction("oracle", num_layers, num_experts, allow_oracle=True)
        oracle = simulate(traces, capacity, belady)
        assert oracle.misses == min_misses(traces, capacity)
        for name in EVICTION_POLICIES:
            other = simulate(traces, capacity, make_eviction(name, num_layers, num_experts))
            assert oracle.hit_ratio >= other.hit_ratio, name


def test_activation_aware_beats_lru_with_strong_reuse():
    model = SyntheticModel(num_layers=8, num_experts=32, top_k=2, reuse=0.95, seed=3)
    traces, _ = model.traces(12, seed=4)
    capacity = 26  # 10% of the experts: a sequence's working set fits, LRU cycles through layers
    aware = simulate(traces, capacity, make_eviction("activation-aware", 8, 32))
    lru = simulate(traces, capacity, make_eviction("lru", 8, 32))
    assert aware.hit_ratio > lru.hit_ratio + 0.05


class Spy:
    """Wraps a policy and checks every victim against the context it was chosen in."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.victims_chosen = 0

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def victims(self, ctx: EvictionContext, count: int, exclude=()):
        keys = self.inner.victims(ctx, count, exclude)
        for key in keys:
            assert self.inner.resident[self.inner.index(key)] and key not in ctx.protected
        self.victims_chosen += len(keys)
        return keys


@pytest.mark.parametrize("name", ALL_EVICTIONS)
def test_protected_keys_never_evicted(name):
    model = SyntheticModel(num_layers=4, num_experts=8, top_k=2, prompt_tokens=(2, 6), new_tokens=(4, 8))
    traces, _ = model.traces(4, seed=5)
    busiest = max(int(np.count_nonzero(t, axis=2).max()) for t in traces)
    spy = Spy(make_eviction(name, 4, 8, allow_oracle=True))
    result = simulate(traces, busiest, spy, make_prefetch("none", 4, 8))  # the Python replay
    assert spy.victims_chosen == result.misses - busiest  # every miss after the cache filled evicted once


@pytest.mark.parametrize("name", ALL_EVICTIONS)
@pytest.mark.parametrize("fraction", [0.3, 0.6])
def test_compiled_replay_matches_the_python_replay(name, fraction):
    """The demand-only replay (kernels.replay) takes exactly the decisions of the Python replay, which
    drives the policy through its public methods as the runtime does."""
    model = SyntheticModel(num_layers=6, num_experts=16, top_k=3, reuse=0.8, seed=11)
    traces, _ = model.traces(6, seed=12)
    capacity = max(int(np.count_nonzero(t, axis=2).max()) for t in traces)
    capacity = max(capacity, round(fraction * 6 * 16))
    compiled_policy = make_eviction(name, 6, 16, allow_oracle=True, prefetching=False)
    compiled = simulate(traces, capacity, compiled_policy)
    python_policy = make_eviction(name, 6, 16, allow_oracle=True, prefetching=False)
    python = simulate(traces, capacity, python_policy, make_prefetch("none", 6, 16))
    assert (compiled.hits, compiled.misses) == (python.hits, python.misses)
    assert 0 < compiled.hits < compiled.accesses
    np.testing.assert_array_equal(compiled_policy.resident, python_policy.resident)
    np.testing.assert_array_equal(compiled_policy.stamp, python_policy.stamp)


@pytest.mark.parametrize("variant", [{}, {"follow": 0.0}, {"recency": 1.0, "distance": False},
                                     {"prior_tokens": None}, {"prior_tokens": 0.0, "follow": 0.5}])
def test_compiled_replay_matches_the_python_replay_with_seeded_counts(variant):
    """The replay folds only the layers each visit grew into activation-aware's state, and keeps the
    per-layer totals as it goes; `select` folds the whole EAM it is handed: same decisions."""
    from moeinf.policy import ActivationAwareEviction

    model = SyntheticModel(num_layers=5, num_experts=12, top_k=2, reuse=0.7, seed=3)
    traces, _ = model.traces(8, seed=4)
    history, _ = model.traces(4, seed=5)
    counts = sum(np.count_nonzero(t, axis=0) for t in history)
    capacity = max(int(np.count_nonzero(t, axis=2).max()) for t in traces) + 6
    compiled_policy = ActivationAwareEviction(5, 12, **variant)
    compiled = simulate(traces, capacity, compiled_policy, counts=counts)
    python_policy = ActivationAwareEviction(5, 12, **variant)
    python = simulate(traces, capacity, python_policy, make_prefetch("none", 5, 12), counts=counts)
    assert (compiled.hits, compiled.misses) == (python.hits, python.misses)
    assert 0 < compiled.hits < compiled.accesses
    np.testing.assert_array_equal(compiled_policy.stamp, python_policy.stamp)
    np.testing.assert_array_equal(compiled_policy.running, python_policy.running)
    np.testing.assert_array_equal(compiled_policy.transition, python_policy.transition)


def test_capacity_below_one_layer_is_an_error():
    trace = trace_of([[{0, 1, 2}]], 4)
    with pytest.raises(PolicyError, match="at least 3"):
        simulate([trace], 2, make_eviction("lru", 1, 4))


def true_eam(trace: np.ndarray):
    """A perfect matcher for one sequence: its own final EAM."""
    eam = trace.sum(axis=0).astype(np.float64)
    return lambda partial, observed: eam


@pytest.mark.parametrize(("bandwidth", "hits", "stall"), [(math.inf, 2, 0.0), (1.0, 1, 2.0), (1.5, 1, 1.0)])
def test_prefetch_transfer_time(bandwidth, hits, stall):
    # layer 0 uses expert 0, layer 1 experts 2 and 3; a perfect prediction after layer 0
    trace = trace_of([[{0}, {2, 3}]], 4)
    result = simulate([trace], 8, make_eviction("lru", 2, 4), make_prefetch("activation-aware", 2, 4),
                      matcher=true_eam(trace), bandwidth=bandwidth)
    assert result.hits == hits
    assert result.prefetches_used == hits
    assert result.prefetch_recall == pytest.approx(hits / 3)
    assert result.prediction_recall == pytest.approx(2 / 3)
    assert result.stall == pytest.approx(0.0 if math.isinf(bandwidth) else stall)
    assert result.prefetch_precision == pytest.approx(1.0 if result.prefetches else 0.0)


def test_no_prefetch_baseline_and_refinement_flag():
    trace = trace_of([[{0}, {2, 3}]], 4)
    none = simulate([trace], 8, make_eviction("lru", 2, 4), make_prefetch("none", 2, 4))
    assert (none.hits, none.misses, none.prefetches, none.prefetch_recall) == (0, 3, 0, 0.0)
    once = simulate([trace], 8, make_eviction("lru", 2, 4),
                    make_prefetch("activation-aware", 2, 4, refine=False), matcher=true_eam(trace))
    assert once.hits == 2 and once.refine is False
    with pytest.raises(PolicyError, match="matcher"):
        simulate([trace], 8, make_eviction("lru", 2, 4), make_prefetch("activation-aware", 2, 4))


def test_perfect_prediction_cuts_stall():
    model = SyntheticModel(num_layers=6, num_experts=16, top_k=2, reuse=0.95, seed=7)
    (trace,), _ = model.traces(1, seed=2)
    none = simulate([trace], 16, make_eviction("activation-aware", 6, 16), make_prefetch("none", 6, 16),
                    bandwidth=2.0)
    aware = simulate([trace], 16, make_eviction("activation-aware", 6, 16),
                     make_prefetch("activation-aware", 6, 16), matcher=true_eam(trace), bandwidth=2.0)
    assert aware.prefetch_recall > 0.0
    assert aware.stall < none.stall
    assert aware.hits > none.hits


def test_nearest_matcher_predicts_on_synthetic_tasks():
    model = SyntheticModel(num_layers=6, num_experts=16, top_k=2, num_tasks=2, reuse=0.95, seed=7)
    train, _ = model.traces(30, seed=1)
    test, _ = model.traces(6, seed=2)
    result = simulate(test, 24, make_eviction("activation-aware", 6, 16),
                      make_prefetch("activation-aware", 6, 16), matcher=NearestEAM(eams_of(train)),
                      bandwidth=2.0)
    assert result.prefetches > 0 and result.prefetches_used > 0
    assert 0.0 < result.prefetch_recall <= result.prediction_recall


def test_nearest_eam_and_bandwidth_helpers():
    eams = np.array([[[1, 0], [0, 1]], [[0, 1], [1, 0]]], dtype=np.float32)
    matcher = NearestEAM(eams)
    np.testing.assert_array_equal(matcher(np.array([[0, 3], [3, 0]]), 1), eams[1])
    np.testing.assert_array_equal(matcher(np.array([[5, 0], [0, 0]]), 1), eams[0])
    assert bandwidth_in_experts(8.0, 8 * 10**6, 0.002) == pytest.approx(2.0)
    with pytest.raises(PolicyError):
        bandwidth_in_experts(0.0, 1, 1.0)


def test_synthetic_traces_shape_and_determinism():
    model = SyntheticModel(num_layers=3, num_experts=8, top_k=2, prompt_tokens=(4, 4), new_tokens=(5, 5))
    traces, tasks = model.traces(3, seed=9)
    again, _ = model.traces(3, seed=9)
    assert [t.shape for t in traces] == [(6, 3, 8)] * 3
    assert all(0 <= task < model.num_tasks for task in tasks)
    for trace, same in zip(traces, again, strict=True):
        np.testing.assert_array_equal(trace, same)
        np.testing.assert_array_equal(trace[0].sum(axis=1), [8, 8, 8])  # 4 prompt tokens x top-2
        np.testing.assert_array_equal(trace[1:].sum(axis=2), np.full((5, 3), 2))
