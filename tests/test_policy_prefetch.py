from __future__ import annotations

import numpy as np
import pytest

from moeinf.config import PREFETCH_POLICIES
from moeinf.policy import (
    ActivationAwarePrefetch,
    PolicyError,
    TopKPrefetch,
    TracedTopKPrefetch,
    make_prefetch,
    popularity,
)

EPS = 1e-4
# L = 4, E = 3: the matched EAM predicts nothing for layer 2
MATCHED = np.array([[4, 0, 0], [1, 1, 2], [0, 0, 0], [0, 3, 1]], dtype=np.float32)


def formula(eam: np.ndarray, layer: int, expert: int) -> float:
    total = eam[layer].sum()
    share = float(eam[layer, expert]) / float(total) if total else 0.0
    return (share + EPS) * (1 - layer / eam.shape[0])


def test_activation_aware_plan_is_algorithm_1():
    policy = ActivationAwarePrefetch(4, 3, eps=EPS)
    plan = policy.plan(0, np.zeros((4, 3)), MATCHED)
    assert [key for key, _ in plan] == [(1, 2), (1, 0), (1, 1), (3, 1), (3, 2)]
    for (layer, expert), priority in plan:
        assert priority == pytest.approx(formula(MATCHED, layer, expert), rel=1e-12)
    # after layer 1 only layer 3 is left
    assert [key for key, _ in policy.plan(1, np.zeros((4, 3)), MATCHED)] == [(3, 1), (3, 2)]
    assert policy.plan(3, np.zeros((4, 3)), MATCHED) == []


def test_activation_aware_unseen_lookahead_and_no_prediction():
    unseen = ActivationAwarePrefetch(4, 3, eps=EPS, include_unseen=True).plan(0, np.zeros((4, 3)), MATCHED)
    keys = [key for key, _ in unseen]
    assert keys == [(1, 2), (1, 0), (1, 1), (3, 1), (3, 2), (2, 0), (2, 1), (2, 2), (3, 0)]
    assert unseen[-1][1] == pytest.approx(EPS * 0.25)
    near = ActivationAwarePrefetch(4, 3, eps=EPS, lookahead=1).plan(0, np.zeros((4, 3)), MATCHED)
    assert [key for key, _ in near] == [(1, 2), (1, 0), (1, 1)]
    assert ActivationAwarePrefetch(4, 3).plan(0, np.zeros((4, 3)), None) == []
    with pytest.raises(PolicyError, match="shape"):
        ActivationAwarePrefetch(4, 3).plan(0, np.zeros((4, 3)), np.zeros((3, 3)))


def test_activation_aware_min_probability_keeps_only_likely_experts():
    # top-1: chances are the shares; layer 1: 0.25 0.25 0.5, layer 3: 0 0.75 0.25
    likely = ActivationAwarePrefetch(4, 3, eps=EPS, top_k=1, min_probability=0.5)
    assert [key for key, _ in likely.plan(0, np.zeros((4, 3)), MATCHED)] == [(1, 2), (3, 1)]
    # top-2 doubles every chance: 0.5 is reached by every expert with a share of 0.25
    pairs = ActivationAwarePrefetch(4, 3, eps=EPS, top_k=2, min_probability=0.5)
    assert [key for key, _ in pairs.plan(0, np.zeros((4, 3)), MATCHED)] == [(1, 2), (1, 0), (1, 1), (3, 1),
                                                                             (3, 2)]
    with pytest.raises(PolicyError, match="min_probability"):
        ActivationAwarePrefetch(4, 3, min_probability=1.5)


def test_refine_off_plans_once_per_pass():
    refining = make_prefetch("activation-aware", 4, 3, EPS)
    once = make_prefetch("activation-aware", 4, 3, EPS, refine=False)
    assert [refining.should_plan(layer) for layer in range(4)] == [True] * 4
    assert [once.should_plan(layer) for layer in range(4)] == [True, False, False, False]


def test_no_prefetch_never_plans():
    assert [make_prefetch("none", 4, 3, EPS).should_plan(layer) for layer in range(4)] == [False] * 4


def test_topk_uses_sequence_history_then_current_layer():
    cur = np.array([[0, 2, 1, 0], [0, 0, 0, 0], [5, 0, 3, 1]], dtype=np.float32)
    plan = TopKPrefetch(3, 4, k=2, eps=EPS).plan(0, cur, None)
    # layer 2 from its own counts; layer 1 (not reached yet) copies layer 0's experts 1 and 2
    assert [key for key, _ in plan] == [(2, 0), (2, 2), (1, 1), (1, 2)]
    assert plan[0][1] == pytest.approx(formula(cur, 2, 0))
    assert plan[2][1] == pytest.approx(EPS * (1 - 1 / 3))
    assert TopKPrefetch(3, 4, k=2).plan(0, np.zeros((3, 4)), None) == []


def test_traced_topk_plans_most_popular():
    eams = [np.array([[1, 0, 0], [0, 2, 1], [3, 0, 0]]), np.array([[0, 1, 0], [0, 1, 3], [0, 0, 1]])]
    pop = popularity(eams)
    np.testing.assert_array_equal(pop, [[1, 1, 0], [0, 3, 4], [3, 0, 1]])
    plan = TracedTopKPrefetch(3, 3, k=1, popularity=pop, eps=EPS).plan(0, np.zeros((3, 3)), None)
    assert [key for key, _ in plan] == [(1, 2), (2, 0)]
    assert plan[0][1] == pytest.approx(formula(pop, 1, 2))


@pytest.mark.parametrize("name", PREFETCH_POLICIES)
def test_factory_builds_config_names(name):
    policy = make_prefetch(name, 4, 3, EPS, top_k=2, popularity=MATCHED)
    assert policy.name == name
    plan = policy.plan(0, MATCHED, MATCHED)
    assert all(key[0] > 0 for key, _ in plan)
    assert [p for _, p in plan] == sorted((p for _, p in plan), reverse=True)


def test_factory_errors():
    with pytest.raises(PolicyError, match="popularity"):
        make_prefetch("traced-topk", 4, 3)
    with pytest.raises(PolicyError, match="unknown prefetch"):
        make_prefetch("random", 4, 3)
    with pytest.raises(PolicyError, match="eps"):
        make_prefetch("none", 4, 3, eps=0.0)
