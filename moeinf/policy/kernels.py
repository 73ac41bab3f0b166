"""Compiled kernels of the eviction policies: victim selection over flat `[L*E]` state arrays, and the
demand-only replay loop of the simulator, which calls the very same selection.

Why compiled (numba) rather than numpy: a replay of a real trace visits ~10^6 (step, layer) pairs per
cache size and policy, most of them with a miss at small caches, and each miss needs a victim. A numpy
victim costs ~10 us in call overheads alone, so a sweep of 30 replays would take many minutes; the
compiled selection costs about a microsecond per thousand resident experts, and the loop around it
nothing. The runtime calls `select` directly (one call per eviction decision).

State (owned by `EvictionPolicy`, passed in): `stamp[i]` the recency clock value of key i (the later of
its last access and insertion; -1 = never), `count[i]` its accesses since reset, `resident[i]` whether
it is in the cache. Key i = layer * E + expert.
"""

from __future__ import annotations

import numpy as np
from numba import njit

LRU, LFU, NEIGHBOR, ORACLE, ACTIVATION = 0, 1, 2, 3, 4
"""Policy kinds (`EvictionPolicy.kind`); Python-side constants only, never exported to another language."""

# params of ACTIVATION (float64 array); the other kinds ignore params
P_EPS, P_ALPHA, P_RECALL, P_LAYER_WEIGHTED, P_FIT, P_NEXT_USE, P_TOP_K = 0, 1, 2, 3, 4, 5, 6
NUM_PARAMS = 7
NEVER = np.iinfo(np.int64).max
"""next_use of a key that is never used again."""
SMALL = 8
"""Up to this many victims per call are kept in a sorted buffer during the scan; more are sorted."""


@njit(cache=True, nogil=True)
def fit_prior(eam: np.ndarray, last: np.ndarray, seen: np.ndarray, num_layers: int, alphas: np.ndarray,
              loglik: np.ndarray, flags: np.ndarray) -> None:
    """Score the tokens routed since the previous decision (the growth of `eam` over `last`) under each
    prior strength in `alphas`, adding to `loglik`; then `last` = `eam`. `flags[0]` = 1 once `last` holds
    a snapshot. A shrinking count means a new sequence (or batch) began: its growth counts from zero."""
    size = eam.size
    num_experts = size // num_layers
    fresh = flags[0] == 0
    if not fresh:
        for i in range(size):
            if eam[i] < last[i]:
                fresh = True
                break
    if fresh:
        last[:] = 0.0
    flags[0] = 1
    for layer in range(num_layers):
        begin, stop = layer * num_experts, (layer + 1) * num_experts
        seen_total = 0.0
        last_total = 0.0
        grown = 0.0
        for i in range(begin, stop):
            seen_total += seen[i]
            last_total += last[i]
            if eam[i] > last[i]:
                grown += 1.0  # the accesses since the snapshot are in `seen` already: take them out
        if grown == 0.0:
            continue
        # the collection before these accesses, smoothed so that no expert has probability 0
        seen_before = max(seen_total - grown, 0.0) + num_experts
        for i in range(begin, stop):
            tokens = eam[i] - last[i]
            if tokens <= 0.0:
                continue
            prior = (max(seen[i] - 1.0, 0.0) + 1.0) / seen_before
            for a in range(alphas.size):
                loglik[a] += tokens * np.log((last[i] + alphas[a] * prior) / (last_total + alphas[a]))
    last[:] = eam


@njit(cache=True, nogil=True)
def select(kind: int, params: np.ndarray, num_layers: int, members: np.ndarray, stamp: np.ndarray,
           count: np.ndarray, blocked: np.ndarray, eam: np.ndarray, layer: int, next_use: np.ndarray,
           alphas: np.ndarray, loglik: np.ndarray, last: np.ndarray, flags: np.ndarray,
           out: np.ndarray) -> int:
    """Write into `out` the keys of `members` (the resident keys, in any order) that are not blocked,
    with the lowest (score, stamp), lowest first, at most `out.size` of them; return how many (fewer
    only when fewer candidates exist). Stamps of resident keys are distinct, so the order of
    `members` does not matter."""
    size = stamp.size
    num_experts = size // num_layers
    # per layer: score = (eam[i] * inv_total + count[i] * prior_scale + eps) * weight for ACTIVATION
    inv_total = np.zeros(num_layers)
    prior_scale = np.zeros(num_layers)
    weight = np.ones(num_layers)
    if kind == ACTIVATION:
        if params[P_FIT] > 0.0:
            fit_prior(eam, last, count, num_layers, alphas, loglik, flags)
            alpha = alphas[np.argmax(loglik)]
        else:
            alpha = params[P_ALPHA]
        for layer_index in range(num_layers):
            eam_total = 0.0
            seen_total = 0.0
            for i in range(layer_index * num_experts, (layer_index + 1) * num_experts):
                eam_total += eam[i]
                seen_total += count[i]
            total = eam_total + alpha
            if total > 0.0:
                inv_total[layer_index] = 1.0 / total
                if seen_total > 0.0:
                    prior_scale[layer_index] = alpha / seen_total / total
            if params[P_LAYER_WEIGHTED] > 0.0:
                weight[layer_index] = 1.0 - params[P_RECALL] * layer_index / num_layers
    eps, next_use_weighted, top_k = params[P_EPS], params[P_NEXT_USE] > 0.0, params[P_TOP_K]
    wanted = out.size
    if wanted <= SMALL:
        # a few victims: keep the best `wanted` so far in a small sorted buffer, in one pass
        best_scores = np.empty(wanted)
        held = 0
        for i in members:
            if blocked[i]:
                continue
            key_layer = i // num_experts
            ahead = -float((key_layer - layer - 1) % num_layers)
            score = _score(kind, eps, next_use_weighted, top_k, num_layers, ahead, count[i], eam[i],
                           next_use[i], inv_total[key_layer], prior_scale[key_layer], weight[key_layer])
            if held == wanted and not _before(score, stamp[i], best_scores[held - 1], stamp[out[held - 1]]):
                continue
            slot = held if held < wanted else wanted - 1
            while slot > 0 and _before(score, stamp[i], best_scores[slot - 1], stamp[out[slot - 1]]):
                best_scores[slot] = best_scores[slot - 1]
                out[slot] = out[slot - 1]
                slot -= 1
            best_scores[slot] = score
            out[slot] = i
            held = min(held + 1, wanted)
        return held
    candidates = np.empty(members.size, dtype=np.int64)
    scores = np.empty(members.size)
    found = 0
    for i in members:
        if not blocked[i]:
            key_layer = i // num_experts
            ahead = -float((key_layer - layer - 1) % num_layers)
            candidates[found] = i
            scores[found] = _score(kind, eps, next_use_weighted, top_k, num_layers, ahead, count[i], eam[i],
                                   next_use[i], inv_total[key_layer], prior_scale[key_layer],
                                   weight[key_layer])
            found += 1
    wanted = min(wanted, found)
    keys = candidates[:found]
    by_stamp = np.argsort(stamp[keys], kind="mergesort")  # stamps are distinct per key: key order is moot
    order = by_stamp[np.argsort(scores[:found][by_stamp], kind="mergesort")]
    out[:wanted] = keys[order[:wanted]]
    return wanted


@njit(cache=True, nogil=True, inline="always")
def _score(kind: int, eps: float, next_use_weighted: bool, top_k: float, num_layers: int, ahead: float,
           count: float, eam: float, next_use: int, inv_total: float, prior_scale: float,
           weight: float) -> float:
    """The eviction score of one key (lowest leaves first) from its own values (scalars: array
    arguments cost reference counting on every call, 30x the LRU scan); see `eviction.py`."""
    if kind == LRU:
        return 0.0
    if kind == LFU:
        return count
    if kind == NEIGHBOR:
        return ahead
    if kind == ORACLE:
        return -float(next_use)
    share = eam * inv_total + count * prior_scale
    if next_use_weighted:
        # expected layer visits until the next use: the visits until layer l comes round again (-ahead),
        # then L per step until a token picks it, with probability p = min(1, top_k * share) per step
        chance = min(1.0, top_k * share) + eps
        return ahead - num_layers * (1.0 / chance - 1.0)
    return (share + eps) * weight


@njit(cache=True, nogil=True, inline="always")
def _before(score: float, stamp: int, other_score: float, other_stamp: int) -> bool:
    """Whether (score, stamp) leaves before (other_score, other_stamp): lower score, then older."""
    return score < other_score or (score == other_score and stamp < other_stamp)


@njit(cache=True, nogil=True)
def replay(kind: int, params: np.ndarray, num_layers: int, capacity: int, keys: np.ndarray,
           tokens: np.ndarray, visit_start: np.ndarray, visit_layer: np.ndarray, new_sequence: np.ndarray,
           next_visit: np.ndarray, stamp: np.ndarray, count: np.ndarray, resident: np.ndarray,
           clock: np.ndarray, alphas: np.ndarray, loglik: np.ndarray, last: np.ndarray,
           flags: np.ndarray) -> tuple[int, int]:
    """Demand-only replay of layer visits through one cache of `capacity` experts; returns (hits, misses).

    Visit v accesses `keys[visit_start[v]:visit_start[v + 1]]` (flat keys of layer `visit_layer[v]`,
    with `tokens` routed to each); `new_sequence[v]` starts a new running EAM. Per visit: the running
    EAM gains the visit's tokens; the missing keys are inserted together, after evicting as many
    victims as they need (chosen at once by `select`, the visit's keys protected); then every key of
    the visit counts as accessed, in key order. `next_visit[a]` is the visit of the next access to the
    key of access a (NEVER if none): the oracle's knowledge.
    """
    size = resident.size
    eam = np.zeros(size)
    blocked = np.zeros(size, dtype=np.bool_)
    next_use = np.full(size, NEVER, dtype=np.int64)
    out = np.empty(size, dtype=np.int64)
    members = np.flatnonzero(resident)  # the resident keys, in slots 0..occupancy-1
    occupancy = members.size
    members = np.concatenate((members, np.zeros(size - occupancy, dtype=np.int64)))
    slot = np.full(size, -1, dtype=np.int64)  # slot[key] = its position in members
    slot[members[:occupancy]] = np.arange(occupancy)
    hits = 0
    misses = 0
    for v in range(visit_layer.size):
        if new_sequence[v]:
            eam[:] = 0.0
        start, stop = visit_start[v], visit_start[v + 1]
        missing = 0
        for a in range(start, stop):
            key = keys[a]
            eam[key] += tokens[a]
            blocked[key] = True
            next_use[key] = next_visit[a]
            if not resident[key]:
                missing += 1
        over = occupancy + missing - capacity
        if over > 0:
            found = select(kind, params, num_layers, members[:occupancy], stamp, count, blocked, eam,
                           visit_layer[v], next_use, alphas, loglik, last, flags, out[:over])
            if found < over:
                return -1, -1  # the caller checks capacity >= the busiest visit, so this cannot happen
            for j in range(over):
                key = out[j]
                resident[key] = False
                occupancy -= 1
                moved = members[occupancy]  # swap-remove: the last member takes the victim's slot
                members[slot[key]] = moved
                slot[moved] = slot[key]
                slot[key] = -1
        for a in range(start, stop):
            key = keys[a]
            if resident[key]:
                hits += 1
            else:
                misses += 1
                resident[key] = True
                members[occupancy] = key
                slot[key] = occupancy
                occupancy += 1
                stamp[key] = clock[0]
                clock[0] += 1
        for a in range(start, stop):
            key = keys[a]
            stamp[key] = clock[0]
            clock[0] += 1
            count[key] += 1.0
            blocked[key] = False
    return hits, misses
