"""Look-ahead prefetch planning and the deliverable cut: exact plans on small arrays, no files."""

from __future__ import annotations

import numpy as np
import pytest

from moeinf.config import PREFETCH_POLICIES, ConfigError, OffloadConfig
from moeinf.policy import PolicyError, make_prefetch
from moeinf.policy.lookahead import (
    LookaheadPrefetch,
    any_token_chance,
    deliverable,
    layer_distance,
    priority,
)

EPS = 1e-4


def test_any_token_chance_combines_tokens() -> None:
    chances = any_token_chance(np.array([[0.5, 0.0, 1.0], [0.5, 0.2, 0.0]]))
    np.testing.assert_allclose(chances, [0.75, 0.2, 1.0])


def test_priorities_follow_deadlines_then_chance() -> None:
    assert priority(1, 0.31, 4, EPS) > priority(2, 1.0, 4, EPS) > priority(2, 0.5, 4, EPS) > 0
    assert priority(1, 1.0, 4, EPS) <= 1.0
    assert layer_distance(1, 3, 4) == 2 and layer_distance(3, 0, 4) == 1 and layer_distance(2, 2, 4) == 4


def test_lookahead_plans_only_predicted_layers_above_the_threshold() -> None:
    policy = LookaheadPrefetch(4, 3, depth=2, top_k=2, min_probability=0.3, eps=EPS)
    ahead = np.array([[0.9, 0.2, 0.4], [0.0, 1.0, 0.3]])  # layers 1 and 2
    plan = policy.plan(0, np.zeros((4, 3)), None, ahead)
    assert [key for key, _ in plan] == [(1, 0), (1, 2), (2, 1), (2, 2)]
    assert plan[0][1] == pytest.approx(priority(1, 0.9, 2, EPS))
    assert policy.plan(0, np.zeros((4, 3)), None, None) == []
    # a row past the last layer is the next pass's (a predictor that wraps), at its distance
    plan = dict(policy.plan(2, np.zeros((4, 3)), None, ahead))
    assert set(plan) == {(3, 0), (3, 2), (0, 1), (0, 2)}
    assert plan[(0, 1)] == pytest.approx(priority(2, 1.0, 2, EPS)) and plan[(0, 1)] < plan[(3, 2)]
    # the lookahead policy plans past the pass only as deep as its depth, and only what is predicted
    assert policy.plan(3, np.ones((4, 3)), None, None) == []


def test_hybrid_fills_deeper_and_next_pass_layers_from_the_eams() -> None:
    cur = np.array([[2, 0, 0], [0, 2, 0], [0, 0, 2], [1, 1, 0]], dtype=float)
    prior = np.array([[4, 0, 0], [0, 0, 4], [0, 0, 4], [0, 4, 0]], dtype=float)
    policy = LookaheadPrefetch(4, 3, depth=1, top_k=1, min_probability=0.3, hybrid=True, prior=prior, eps=EPS)
    ahead = np.array([[0.0, 0.0, 0.9]])  # layer 2 predicted: the EAMs are ignored there
    plan = dict(policy.plan(1, cur, None, ahead))
    assert set(plan) == {(2, 2), (3, 1)}  # layer 3: mean share (0.5 + 1) / 2 = 0.75 for expert 1
    assert plan[(2, 2)] > plan[(3, 1)]
    # from the last layer the next pass's layer 0 is planned (distance 1), from the mean of cur and prior
    plan = dict(policy.plan(3, cur, None, None))
    assert set(plan) == {(0, 0)} and plan[(0, 0)] == pytest.approx(priority(1, 1.0, 4, EPS))


def _row_plan(policy: LookaheadPrefetch, layer: int, eam: np.ndarray, matched: np.ndarray | None,
              prior: np.ndarray, ahead: np.ndarray | None) -> dict[tuple[int, int], float]:
    """One row's plan written out plainly: chance per (later layer, expert), then `priority`."""
    plan = {}
    for later in range(policy.num_layers):
        if later == layer:
            continue
        distance = layer_distance(layer, later, policy.num_layers)
        if distance > policy.wrap and later < layer:
            continue
        for expert in range(policy.num_experts):
            if ahead is not None and distance <= ahead.shape[0]:  # past the last layer: the next pass's
                chance = ahead[distance - 1, expert]
            else:
                shares = [src[later, expert] / src[later].sum() for src in (eam, matched, prior)
                          if src is not None and src[later].sum() > 0]
                if not shares:
                    continue
                chance = min(policy.top_k * sum(shares) / len(shares), 1.0)
            if chance >= max(policy.min_probability, EPS):
                plan[(later, expert)] = priority(distance, chance, policy.span, EPS)
    return plan


@pytest.mark.parametrize("layer", [0, 2, 5])
def test_batch_plan_equals_the_merge_of_the_row_plans(layer: int) -> None:
    """One pass over the batch gives what planning each row and keeping each key's highest priority
    gives, in the same order."""
    rng = np.random.default_rng(layer)
    layers, experts, rows = 6, 8, 5
    eams = rng.integers(0, 3, (rows, layers, experts)).astype(float)
    eams[1, 3:] = 0  # a row that has not reached the deeper layers yet
    matched = [rng.integers(0, 4, (layers, experts)).astype(float) if b % 2 else None for b in range(rows)]
    prior = rng.integers(0, 5, (layers, experts)).astype(float)
    ahead = rng.random((2, experts))
    policy = LookaheadPrefetch(layers, experts, depth=2, top_k=2, min_probability=0.3, hybrid=True,
                               prior=prior, eps=EPS)
    merged: dict[tuple[int, int], float] = {}
    for b in range(rows):
        for key, p in _row_plan(policy, layer, eams[b], matched[b], prior, ahead).items():
            merged[key] = max(p, merged.get(key, -1.0))
    expected = sorted(merged.items(), key=lambda item: (-item[1], item[0]))
    plan = policy.plan_batch(layer, eams, matched, ahead)
    assert [key for key, _ in plan] == [key for key, _ in expected]
    np.testing.assert_allclose([p for _, p in plan], [p for _, p in expected], rtol=0, atol=1e-12)
    assert len(plan) > 5


def test_deliverable_keeps_the_reads_that_can_start_in_time() -> None:
    plan = [((1, 0), 0.9), ((1, 1), 0.8), ((2, 0), 0.7), ((2, 1), 0.6), ((3, 0), 0.5)]
    distances = [1, 1, 2, 2, 3]
    # half a read per layer: one read may start before layer 1, none more before layer 3 (1 < 1.5)
    assert [k for k, _ in deliverable(plan, distances, set(), 0.5)] == [(1, 0), (3, 0)]
    # resident entries cost nothing
    kept = deliverable(plan, distances, {(1, 0)}, 0.5)
    assert [k for k, _ in kept] == [(1, 0), (1, 1), (3, 0)]
    assert deliverable(plan, distances, set(), 0.0) == []
    assert deliverable(plan, distances, set(), 10.0) == plan
    with pytest.raises(PolicyError, match="distances"):
        deliverable(plan, distances[:2], set(), 1.0)


def test_factory_and_config_know_the_lookahead_choices() -> None:
    assert {"lookahead", "hybrid"} <= set(PREFETCH_POLICIES)
    policy = make_prefetch("hybrid", 4, 3, EPS, top_k=2, depth=2, min_probability=0.3)
    assert isinstance(policy, LookaheadPrefetch) and policy.hybrid and policy.depth == 2
    with pytest.raises(PolicyError, match="depth"):
        make_prefetch("lookahead", 4, 3, EPS, depth=0)
    assert OffloadConfig().prefetch in PREFETCH_POLICIES
    with pytest.raises(ConfigError, match="lookahead_depth"):
        OffloadConfig(lookahead_depth=0)
    with pytest.raises(ConfigError, match="lookahead_predictor"):
        OffloadConfig(lookahead_predictor="")


def test_transitions_count_which_experts_follow_and_calibrate_their_chances() -> None:
    from moeinf.policy.lookahead import Transitions

    rng = np.random.default_rng(0)
    # 3 layers of 8 experts, top-2: a token at e < 4 and e + 4 in layer 0 goes to e + 1 and a random other
    # expert in layer 1, then e + 2 and a random other in layer 2
    requests = []
    for _ in range(20):
        first = rng.integers(0, 4, size=(30, 1))
        ids = np.zeros((30, 3, 2), dtype=np.int64)
        ids[:, 0, 0] = first[:, 0]
        ids[:, 0, 1] = (first[:, 0] + 4) % 8
        for layer in (1, 2):
            ids[:, layer, 0] = (ids[:, layer - 1, 0] + 1) % 8
            ids[:, layer, 1] = (ids[:, layer, 0] + 1 + rng.integers(0, 6, size=30)) % 8
        requests.append(ids)
    transitions = Transitions.fit(requests, 3, 8, depth=2)
    assert (transitions.depth, transitions.num_layers, transitions.num_experts) == (2, 3, 8)
    # every token at expert 3 of layer 0 goes to expert 4 at layer 1 and 5 at layer 2
    assert transitions.cond[0, 0, 3, 4] == 1.0 and transitions.cond[1, 0, 3, 5] == 1.0
    np.testing.assert_allclose(transitions.cond[0, 0].sum(axis=1), 2.0, rtol=1e-6)  # k experts follow
    assert np.all(np.diff(transitions.calibration) >= 0)
    chances = transitions.chances(0, np.array([[3, 7]]))  # [D, T, E]
    assert chances.shape == (2, 1, 8)
    assert chances[0, 0].argmax() == 4 and chances[1, 0].argmax() == 5
    assert chances[0, 0, 4] > 0.9  # calibrated: the sure follower is called sure
    assert transitions.chances(1, np.array([[0, 1]])).shape == (1, 1, 8)  # one layer left after layer 1
    assert transitions.chances(2, np.array([[0, 1]])) is None
    with pytest.raises(PolicyError, match="depth"):
        Transitions.fit(requests, 3, 8, depth=0)


def test_transitions_ignore_ids_outside_the_experts() -> None:
    from moeinf.policy.lookahead import Transitions

    ids = np.array([[[0, -1], [1, 8]]] * 4)  # [T=4, L=2, k=2]
    transitions = Transitions.fit([ids], 2, 4, depth=1)
    assert transitions.cond[0, 0, 0, 1] == 1.0 and transitions.cond[0, 0].sum() == 1.0
    assert transitions.chances(0, np.array([[0, -1]]))[0, 0].argmax() == 1


def _two_witness_routing(seed: int = 0, requests: int = 10, tokens: int = 60) -> list[np.ndarray]:
    """3 layers of 4 experts, top-1: layer 0 routes a token to a in {0, 1}, layer 1 to b in {0, 1} (both at
    random), layer 2 to 2a + b. Either earlier layer alone leaves two experts of layer 2 equally likely; the
    two together name it."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(requests):
        a, b = rng.integers(0, 2, size=(2, tokens))
        out.append(np.stack([a, b, 2 * a + b], axis=1)[:, :, None])  # [T, L, k=1]
    return out


def test_transitions_join_a_tokens_earlier_layers() -> None:
    from moeinf.policy.lookahead import Transitions

    routing = _two_witness_routing()
    one = Transitions.fit(routing, 3, 4, depth=2)
    joined = Transitions.fit(routing, 3, 4, depth=2, sources=3)
    assert one.sources == 1 and one.prior is None and one.joint is None
    # a prediction 1 layer ahead of layer 1 can join layer 0 (2 ahead of layer 2, within the depth); no more
    assert joined.sources == 2 and joined.prior.shape == (3, 4) and joined.joint.shape == (1, 20)
    np.testing.assert_allclose(joined.prior[2], 0.25, atol=0.05)
    np.testing.assert_array_equal(joined.cond, one.cond)  # the same counts, more use of them
    for a in (0, 1):
        for b in (0, 1):
            alone = joined.chances(1, np.array([[b]]))  # [D'=1, T=1, E]
            np.testing.assert_allclose(alone, one.chances(1, np.array([[b]])))  # no earlier layer: as before
            assert sorted(np.flatnonzero(alone[0, 0] > 0.3)) == [b, 2 + b]  # two candidates, each ~0.5
            both = joined.chances(1, np.array([[b]]), [np.array([[a]])])
            assert both.shape == (1, 1, 4)
            assert both[0, 0].argmax() == 2 * a + b and both[0, 0, 2 * a + b] > 0.9
            assert np.sum(both[0, 0] > 0.3) == 1
    # the one-layer fit ignores the earlier layer; an earlier row of other tokens is not joined
    np.testing.assert_allclose(one.chances(1, np.array([[1]]), [np.array([[0]])]),
                               one.chances(1, np.array([[1]])))
    np.testing.assert_allclose(joined.chances(1, np.array([[1]]), [np.array([[0], [1]])]),
                               joined.chances(1, np.array([[1]])))
    # layer 0 has nothing before it
    np.testing.assert_allclose(joined.chances(0, np.array([[1]]), [np.array([[0]])]),
                               joined.chances(0, np.array([[1]])))
    with pytest.raises(PolicyError, match="sources"):
        Transitions.fit(routing, 3, 4, depth=2, sources=0)


def test_transition_layers_setting_is_checked() -> None:
    assert OffloadConfig().lookahead_transition_layers == 3
    with pytest.raises(ConfigError, match="lookahead_transition_layers"):
        OffloadConfig(lookahead_transition_layers=0)
