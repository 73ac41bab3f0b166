"""Expert placement over ranks (moeinf.parallel.placement): pure numpy, exact figures on small cases."""

from __future__ import annotations

import numpy as np
import pytest

from moeinf.parallel.placement import balanced, round_robin, step_imbalance, token_pairs


def test_round_robin_deals_experts_in_turn() -> None:
    owner = round_robin(2, 5, 2)
    assert owner.tolist() == [[0, 1, 0, 1, 0], [0, 1, 0, 1, 0]]


def test_ranks_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="ranks"):
        round_robin(1, 4, 5)
    with pytest.raises(ValueError, match="ranks"):
        balanced(np.ones((1, 4)), None, 0)


def test_step_imbalance_is_busiest_over_mean() -> None:
    owner = np.array([[0, 0, 1, 1]])
    # one token to experts 0 and 1 (both rank 0): 2 vs 0 pairs -> 2 / 1 = 2.0;
    # one token to experts 0 and 2: 1 vs 1 -> 1.0; weighted by pairs (2 each): 1.5
    records = [(0, np.array([[0, 1]])), (0, np.array([[0, 2]]))]
    assert step_imbalance(owner, records, 2).tolist() == [1.5]


def test_balanced_keeps_memory_even_and_evens_load() -> None:
    load = np.array([[8.0, 4.0, 2.0, 1.0, 1.0, 0.0]])
    owner = balanced(load, None, 2)
    assert np.bincount(owner[0], minlength=2).tolist() == [3, 3]
    per_rank = [load[0][owner[0] == r].sum() for r in range(2)]
    assert per_rank == [9.0, 7.0]  # 8+1+0 and 4+2+1: the greedy split, busiest expert first


def test_co_activation_spreads_experts_used_together() -> None:
    # Tokens use experts 0 and 2 together, or 1 and 3: round-robin (by parity) puts each pair on one rank.
    rng = np.random.default_rng(0)
    pairs = np.array([[0, 2], [1, 3]])
    ids = pairs[rng.integers(0, 2, size=400)]  # [T, 2]
    records = [(0, ids[i : i + 1]) for i in range(len(ids))]  # one decode step per token
    load, coact = token_pairs(records, 1, 4)
    assert coact[0, 0, 2] == coact[0, 2, 0] == load[0, 0]
    owner = balanced(load, coact, 2)
    assert owner[0, 0] != owner[0, 2] and owner[0, 1] != owner[0, 3]
    assert step_imbalance(owner, records, 2).tolist() == [1.0]
    assert step_imbalance(round_robin(1, 4, 2), records, 2).tolist() == [2.0]
