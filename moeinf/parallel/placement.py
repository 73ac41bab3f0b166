"""Which rank owns which expert: round-robin, or balanced from traced activations.

An owner map is an int array `[L, E]`: `owner[l, e]` is the rank holding expert `e` of MoE layer `l`.
Every rank holds the same number of experts per layer (within one), so memory stays even; what a
placement can change is how the tokens of one step spread over the ranks. A step's cost on the
expert-parallel path is set by its busiest rank, so the figure of merit is, per layer and step,
max over ranks / mean over ranks of the (token, expert) pairs each rank computes.

`balanced` assigns the experts of each layer greedily, busiest first, to the rank where it adds the least
expected work: the rank's traced load so far plus the tokens it shares with experts already there
(co-activation: two experts a token uses together on one rank make that rank compute twice for it while
another may idle). Pure numpy: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def round_robin(num_layers: int, num_experts: int, ranks: int) -> np.ndarray:
    """`owner[l, e] = e mod ranks`: the baseline placement."""
    _check_ranks(num_experts, ranks)
    return np.tile(np.arange(num_experts) % ranks, (num_layers, 1))


def balanced(load: np.ndarray, coactivation: np.ndarray | None, ranks: int, *,
             spread: float = 1.0) -> np.ndarray:
    """Owner map from traced `load` `[L, E]` (tokens per expert) and `coactivation` `[L, E, E]`
    (tokens that used both experts; None to balance load alone). `spread` weighs co-activation against
    load. Each rank gets `ceil` or `floor` of E / ranks experts per layer."""
    num_layers, num_experts = load.shape
    _check_ranks(num_experts, ranks)
    quota = np.full(ranks, num_experts // ranks)
    quota[: num_experts % ranks] += 1
    owner = np.empty((num_layers, num_experts), dtype=np.int64)
    for layer in range(num_layers):
        rank_load = np.zeros(ranks)
        shared = np.zeros((ranks, num_experts))  # tokens each rank's experts share with each expert
        taken = np.zeros(ranks, dtype=np.int64)
        for expert in np.argsort(-load[layer], kind="stable"):
            cost = rank_load + (spread * shared[:, expert] if coactivation is not None else 0.0)
            cost = np.where(taken < quota, cost, np.inf)
            rank = int(np.argmin(cost))
            owner[layer, expert] = rank
            taken[rank] += 1
            rank_load[rank] += load[layer, expert]
            if coactivation is not None:
                shared[rank] += coactivation[layer, expert]
    return owner


def token_pairs(step_experts: Iterable[tuple[int, np.ndarray]], num_layers: int,
                num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """`(load [L, E], coactivation [L, E, E])` from `(layer, ids [T, k])` routing records."""
    load = np.zeros((num_layers, num_experts))
    coact = np.zeros((num_layers, num_experts * num_experts))
    for layer, ids in step_experts:
        ids = ids[(ids >= 0).all(axis=1)]
        if ids.size == 0:
            continue
        load[layer] += np.bincount(ids.ravel(), minlength=num_experts)
        k = ids.shape[1]
        first, second = np.triu_indices(k, 1)
        a, b = ids[:, first].ravel(), ids[:, second].ravel()
        coact[layer] += np.bincount(a * num_experts + b, minlength=num_experts * num_experts)
        coact[layer] += np.bincount(b * num_experts + a, minlength=num_experts * num_experts)
    return load, coact.reshape(num_layers, num_experts, num_experts)


def step_imbalance(owner: np.ndarray, step_experts: Iterable[tuple[int, np.ndarray]],
                   ranks: int) -> np.ndarray:
    """Per layer, the mean over steps of max/mean (token, expert) pairs per rank: `[L]` (1.0 = even).

    Steps are weighted by their pairs, so a long prefill counts as much as its tokens."""
    num_layers = owner.shape[0]
    weighted = np.zeros(num_layers)
    total = np.zeros(num_layers)
    for layer, ids in step_experts:
        ids = ids[ids >= 0]
        if ids.size == 0:
            continue
        per_rank = np.bincount(owner[layer, ids], minlength=ranks)  # [R]
        ratio = per_rank.max() / per_rank.mean()
        weighted[layer] += ratio * ids.size
        total[layer] += ids.size
    return np.divide(weighted, total, out=np.ones(num_layers), where=total > 0)


def _check_ranks(num_experts: int, ranks: int) -> None:
    if not 1 <= ranks <= num_experts:
        raise ValueError(f"ranks: {ranks} ranks cannot share {num_experts} experts per layer; "
                         f"use 1 to {num_experts} ranks")
