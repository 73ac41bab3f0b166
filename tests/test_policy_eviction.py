from __future__ import annotations

import numpy as np
import pytest

from moeinf.config import EVICTION_POLICIES
from moeinf.policy import (
    ActivationAwareEviction,
    EvictionContext,
    LFUEviction,
    LRUEviction,
    NeighborEviction,
    OracleEviction,
    PolicyError,
    layer_priorities,
    make_eviction,
)

EPS = 1e-4
PAPER = {"recency": 1.0, "distance": False, "follow": 0.0}
"""ActivationAwareEviction arguments of the paper's Algorithm 2: plain counts, no distance, no transitions."""
# L = 4, E = 3: layer 2 has no tokens yet
CUR_EAM = np.array([[4, 0, 0], [1, 1, 2], [0, 0, 0], [0, 3, 1]], dtype=np.float32)


def ctx(layer: int = 0, protected: tuple = (), **kwargs) -> EvictionContext:
    return EvictionContext(cur_eam=kwargs.pop("cur_eam", None), layer=layer, protected=frozenset(protected),
                           **kwargs)


def insert_all(policy, keys) -> list:
    for key in keys:
        policy.on_insert(key)
    return list(keys)


def test_layer_priorities_is_algorithm_formula():
    got = layer_priorities(CUR_EAM, EPS)
    for layer in range(4):
        total = CUR_EAM[layer].sum()
        for expert in range(3):
            share = float(CUR_EAM[layer, expert]) / float(total) if total else 0.0
            assert got[layer, expert] == pytest.approx((share + EPS) * (1 - layer / 4), rel=1e-12)


def test_activation_aware_victim_order():
    policy = ActivationAwareEviction(4, 3, eps=EPS, prior_tokens=0, **PAPER)  # the paper's formula
    # (2,2) is inserted before (2,0): equal priority eps * 0.5, so LRU picks (2,2) first
    insert_all(policy, [(1, 0), (3, 1), (2, 2), (2, 0), (0, 1), (3, 2)])
    order = policy.victims(ctx(cur_eam=CUR_EAM), count=6)
    # priorities: (2,*) 5e-5, (0,1) 1e-4, (3,2) 0.062525, (3,1) 0.187525, (1,0) 0.187575
    assert order == [(2, 2), (2, 0), (0, 1), (3, 2), (3, 1), (1, 0)]


def test_activation_aware_layer_term_follows_prefetch_recall():
    policy = ActivationAwareEviction(4, 3, eps=EPS, prior_tokens=0, **PAPER)
    insert_all(policy, [(0, 1), (3, 2)])
    # (0, 1) has no token in CUR_EAM: eps, below (3, 2)'s 0.25 * (1 - 3/4)
    assert policy.victim(ctx(cur_eam=CUR_EAM)) == (0, 1)
    # shares: (0, 1) 0.2, (3, 2) 0.25
    eam = np.array([[4, 1, 0], [1, 1, 2], [0, 0, 0], [0, 3, 1]], dtype=np.float32)
    assert policy.victim(ctx(cur_eam=eam)) == (3, 2)  # 0.25 * 0.25 < 0.2 * 1
    # no layer term: 0.2 < 0.25
    assert policy.victim(ctx(cur_eam=eam, prefetch_recall=0.0)) == (0, 1)


def test_activation_aware_skips_protected_and_needs_eam():
    policy = ActivationAwareEviction(4, 3, eps=EPS, prior_tokens=0, **PAPER)
    insert_all(policy, [(2, 0), (0, 1), (3, 2)])
    assert policy.victim(ctx(layer=2, protected=[(2, 0)], cur_eam=CUR_EAM)) == (0, 1)
    assert policy.victim(ctx(layer=2, protected=[(2, 0)], cur_eam=CUR_EAM), exclude=[(0, 1)]) == (3, 2)
    with pytest.raises(PolicyError, match="cur_eam"):
        policy.victim(ctx())
    with pytest.raises(PolicyError, match="shape"):
        policy.victim(ctx(cur_eam=np.zeros((2, 3))))


def test_activation_aware_prior_keeps_the_collection_popular_expert_of_a_new_sequence():
    policy = ActivationAwareEviction(2, 3, eps=EPS, prior_tokens=4, layer_weighted=False, **PAPER)
    for _ in range(6):
        policy.on_access((1, 2))  # earlier sequences used (1, 2) a lot
    policy.on_access((1, 0))
    insert_all(policy, [(1, 2), (1, 0), (1, 1)])
    fresh = np.zeros((2, 3), dtype=np.float32)  # a new sequence: no count yet
    assert policy.victims(ctx(cur_eam=fresh), count=3) == [(1, 1), (1, 0), (1, 2)]
    # once the sequence's own tokens outweigh the prior, they decide: (1, 1) is this sequence's expert
    own = np.array([[0, 0, 0], [0, 20, 0]], dtype=np.float32)
    assert policy.victims(ctx(cur_eam=own), count=3) == [(1, 0), (1, 2), (1, 1)]


def _simulated_alpha(traces: list[np.ndarray], num_layers: int, num_experts: int, capacity: int) -> float:
    from moeinf.policy.simulate import simulate

    policy = ActivationAwareEviction(num_layers, num_experts, layer_weighted=False, prior_tokens=None,
                                     **PAPER)
    simulate(traces, capacity, policy)
    return policy.alpha


def test_activation_aware_fits_the_prior_strength_to_the_workload():
    from moeinf.policy.synthetic import SyntheticModel

    # sequences that each keep reusing their own few experts: their own counts should decide
    reuse, _ = SyntheticModel(num_layers=4, num_experts=16, top_k=2, reuse=0.95, seed=1).traces(8, seed=2)
    assert _simulated_alpha(reuse, 4, 16, capacity=12) <= 32
    # every token drawn from one global popularity: the collection should decide
    rng = np.random.default_rng(0)
    popular = rng.dirichlet(np.full(16, 0.3), size=4)  # [L, E]
    traces = []
    for _ in range(8):
        steps = np.zeros((40, 4, 16), dtype=np.int64)
        for step in steps:
            for layer in range(4):
                step[layer, rng.choice(16, size=2, replace=False, p=popular[layer])] = 1
        traces.append(steps)
    assert _simulated_alpha(traces, 4, 16, capacity=12) >= 128


def test_lru_victim_order():
    policy = LRUEviction(2, 2)
    insert_all(policy, [(0, 0), (0, 1), (1, 0), (1, 1)])
    policy.on_access((0, 0))
    policy.on_access((1, 0))
    assert policy.victims(ctx(), count=4) == [(0, 1), (1, 1), (0, 0), (1, 0)]
    assert policy.victims(ctx(), count=9) == [(0, 1), (1, 1), (0, 0), (1, 0)]  # no more than resident
    assert policy.victim(ctx(layer=0, protected=[(0, 1)])) == (1, 1)
    policy.on_evict((0, 1))
    assert policy.victims(ctx(), count=4) == [(1, 1), (0, 0), (1, 0)]


def test_lfu_victim_order_and_memory_across_eviction():
    policy = LFUEviction(3, 3)
    resident = insert_all(policy, [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)])
    for key in [(0, 0), (0, 0), (0, 0), (0, 2), (0, 2), (0, 1)]:
        policy.on_access(key)
    # counts: (0,0)=3, (0,2)=2, (0,1)=1, (1,0)=(1,1)=0; the zero-count tie goes to the older insertion
    assert policy.victims(ctx(), count=5) == [(1, 0), (1, 1), (0, 1), (0, 2), (0, 0)]
    for key in resident:
        policy.on_evict(key)
    policy.on_insert((0, 0))
    policy.on_insert((2, 0))
    assert policy.victim(ctx()) == (2, 0)  # (0,0) keeps its 3 accesses
    policy.reset()
    with pytest.raises(PolicyError, match="all 0 resident"):
        policy.victim(ctx())  # reset empties the cache
    insert_all(policy, [(2, 0), (0, 0)])
    assert policy.victim(ctx()) == (2, 0)  # no history: the older insertion


def test_neighbor_victim_order():
    policy = NeighborEviction(4, 3)
    insert_all(policy, [(2, 0), (3, 1), (0, 2), (0, 0), (1, 1), (1, 0)])
    # at layer 1 the next layers needed are 2, 3, 0, then 1 again: evict layer 1, 0, 3, 2
    order = policy.victims(ctx(layer=1, protected=[(1, 0)]), count=5)
    assert order == [(1, 1), (0, 2), (0, 0), (3, 1), (2, 0)]
    with pytest.raises(PolicyError, match="num_layers"):
        NeighborEviction(0, 3)


def test_oracle_evicts_farthest_next_use():
    policy = OracleEviction(3, 2)
    insert_all(policy, [(0, 0), (0, 1), (2, 1), (1, 0), (2, 0), (1, 1)])
    future = [(0, 1), (1, 1), (0, 0), (1, 1)]
    # never used again: (2,1), (1,0), (2,0) in insertion order, then (0,0) at 2, (1,1) at 1, (0,1) at 0
    expected = [(2, 1), (1, 0), (2, 0), (0, 0), (1, 1), (0, 1)]
    assert policy.victims(ctx(future=future), count=6) == expected
    next_use = np.full(6, np.iinfo(np.int64).max)
    next_use[[1, 3, 0]] = [10, 11, 12]  # (0, 1), (1, 1), (0, 0)
    assert policy.victims(ctx(next_use=next_use), count=6) == expected


@pytest.mark.parametrize("name", EVICTION_POLICIES)
def test_every_policy_refuses_when_all_protected(name):
    policy = make_eviction(name, 2, 2, EPS)
    resident = insert_all(policy, [(0, 0), (0, 1)])
    with pytest.raises(PolicyError, match="capacity"):
        policy.victim(ctx(protected=resident, cur_eam=np.ones((2, 2))))
    assert policy.victims(ctx(protected=resident[:1], cur_eam=np.ones((2, 2))), 2, exclude=resident[1:]) == []


@pytest.mark.parametrize("name", EVICTION_POLICIES)
def test_factory_builds_config_names(name):
    policy = make_eviction(name, 4, 3, EPS)
    assert policy.name == name
    assert not policy.needs_future


def test_factory_oracle_only_in_simulation():
    with pytest.raises(PolicyError, match="simulator"):
        make_eviction("oracle", 4, 3)
    assert make_eviction("oracle", 4, 3, allow_oracle=True).needs_future
    with pytest.raises(PolicyError, match="unknown eviction"):
        make_eviction("fifo", 4, 3)


def test_activation_aware_default_scores_share_per_layer_visit_until_needed():
    """score = (share + eps) / (ahead + 1): the share of the running sequence (no prior, no history)."""
    eam = np.array([[3, 1], [1, 3]], dtype=np.float32)
    keys = [(1, 0), (0, 1), (0, 0), (1, 1)]
    paper = ActivationAwareEviction(2, 2, eps=EPS, prior_tokens=0, layer_weighted=False, **PAPER)
    insert_all(paper, keys)
    # shares 0.25, 0.25, 0.75, 0.75: ties by insertion
    assert paper.victims(ctx(cur_eam=eam), count=4) == [(1, 0), (0, 1), (0, 0), (1, 1)]
    policy = ActivationAwareEviction(2, 2, eps=EPS, prior_tokens=0, follow=0.0)
    insert_all(policy, keys)
    # after layer 0, layer 1 comes next (ahead 0) and layer 0 last (ahead 1): scores
    # (0,1) 0.25/2, (0,0) 0.75/2, (1,0) 0.25/1, (1,1) 0.75/1
    assert policy.victims(ctx(layer=0, cur_eam=eam), count=4) == [(0, 1), (1, 0), (0, 0), (1, 1)]
    # after layer 1 the order of the layers turns round: (1,1) 0.375 is worth less than (0,0) 0.75
    assert policy.victims(ctx(layer=1, cur_eam=eam), count=4) == [(1, 0), (0, 1), (1, 1), (0, 0)]


def test_activation_aware_recency_decays_older_tokens():
    """Expert 0 served 3 tokens long ago, expert 1 the 2 latest ones: plain counts keep 0, recency keeps 1."""
    keys = [(0, 1), (0, 0)]
    steps = [np.array([[3, 0]]), np.array([[3, 1]]), np.array([[3, 2]])]  # one decision per token
    victims = {}
    for recency in (1.0, 0.3):
        policy = ActivationAwareEviction(1, 2, eps=EPS, prior_tokens=0, recency=recency, follow=0.0)
        insert_all(policy, keys)
        for eam in steps:
            chosen = policy.victim(ctx(cur_eam=eam.astype(np.float32)))
        victims[recency] = chosen
    # plain counts 3 vs 2; decayed 3 * 0.09 = 0.27 vs 1 * 0.3 + 1 = 1.3
    assert victims == {1.0: (0, 1), 0.3: (0, 0)}
    # a new sequence (a count shrank) starts from zero: only its own tokens count
    policy = ActivationAwareEviction(1, 2, eps=EPS, prior_tokens=0, recency=0.3, follow=0.0)
    insert_all(policy, keys)
    policy.victim(ctx(cur_eam=np.array([[0, 9]], dtype=np.float32)))
    assert policy.victim(ctx(cur_eam=np.array([[1, 0]], dtype=np.float32))) == (0, 1)


def test_activation_aware_follows_the_collection_transitions():
    """Expert 2 always served the token after one that expert 0 served: once learned, a token served by
    expert 0 keeps expert 2 over expert 1, which this sequence used as often."""
    policy = ActivationAwareEviction(1, 3, eps=EPS, prior_tokens=0, recency=1.0, follow=0.9)
    insert_all(policy, [(0, 2), (0, 1), (0, 0)])
    eam = np.zeros((1, 3), dtype=np.float32)
    for expert in (0, 2, 1, 0, 2, 1, 0, 2, 1):  # one token (and one decision) at a time
        eam[0, expert] += 1
        policy.victim(ctx(cur_eam=eam))
    row = policy.transition[0]
    assert row.tolist() == [0.0, 0.0, 3.0, 3.0]  # 0 -> 2 three times (column 3: the row's total)
    eam[0, 0] += 1  # the next token goes to expert 0: expert 2 should follow
    # follow 0.9: shares (4, 3, 3) / 10 * 0.1 + 0.9 * (0, 0, ~1) -> (0, 1) leaves before (0, 2)
    assert policy.victims(ctx(cur_eam=eam, protected=[(0, 0)]), count=2) == [(0, 1), (0, 2)]
    without = ActivationAwareEviction(1, 3, eps=EPS, prior_tokens=0, recency=1.0, follow=0.0)
    insert_all(without, [(0, 2), (0, 1), (0, 0)])
    assert without.victims(ctx(cur_eam=eam, protected=[(0, 0)]), count=2) == [(0, 2), (0, 1)]


def test_a_growth_of_several_tokens_teaches_every_transition_and_predicts_their_weighted_mean():
    """A decision can fold in several tokens of a layer at once (a prefill, or tokens since the last miss):
    every (previous expert, grown expert) pair is learned, first uses weigh in before the transitions read
    the collection, and FOLLOW is the token-weighted mean of the grown experts' rows, each smoothed by the
    collection's share."""
    from moeinf.policy import kernels

    experts = 4
    params = np.zeros(kernels.NUM_PARAMS)
    params[[kernels.P_RECENCY, kernels.P_SLOW, kernels.P_FOLLOW, kernels.P_FIRST]] = 0.5, 1.0, 0.5, 8.0
    running, layer_state = np.zeros((5, experts)), np.zeros((3, 1))
    transition = np.zeros((experts, experts + 1))
    seen = np.array([5.0, 1.0, 0.0, 2.0])
    layer_seen = np.array([seen.sum()])
    eam = np.zeros(experts)
    for growth in ([2, 0, 0, 1], [0, 1, 3, 0], [1, 0, 0, 2]):
        eam += growth
        kernels.observe_layer(0, experts, eam, running, layer_state, transition, seen, params, np.ones(1),
                              np.zeros(1), layer_seen)
    assert seen.tolist() == [13.0, 9.0, 8.0, 10.0] and layer_seen.tolist() == [40.0]  # each used once: +8
    learned = np.zeros((experts, experts + 1))
    learned[np.ix_([0, 3], [1, 2])] = 1.0  # {0, 3} -> {1, 2}, then {1, 2} -> {0, 3}
    learned[np.ix_([1, 2], [0, 3])] = 1.0
    learned[:, experts] = 2.0
    np.testing.assert_array_equal(transition, learned)
    share = seen / seen.sum()
    row = lambda i: (learned[i, :experts] + kernels.TRANSITION_PRIOR * share) / (  # noqa: E731
        learned[i, experts] + kernels.TRANSITION_PRIOR)
    np.testing.assert_allclose(running[kernels.FOLLOW], (1 * row(0) + 2 * row(3)) / 3, rtol=1e-12)
    assert layer_state[kernels.FOLLOWED, 0] == 1.0


def test_reset_seeds_counts_from_a_collection():
    policy = LFUEviction(1, 3)
    insert_all(policy, [(0, 0), (0, 1), (0, 2)])
    policy.reset(np.array([[5, 0, 2]]))
    insert_all(policy, [(0, 0), (0, 1), (0, 2)])
    assert policy.victims(ctx(), count=3) == [(0, 1), (0, 2), (0, 0)]
    with pytest.raises(PolicyError, match="whole numbers"):
        policy.reset(np.array([[0.5, 0, 0]]))
