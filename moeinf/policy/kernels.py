"""Compiled kernels of the eviction policies: victim selection over flat `[L*E]` state arrays, and the
demand-only replay loop of the simulator, which calls the very same selection.

Why compiled (numba) rather than numpy: a replay of a real trace visits ~10^6 (step, layer) pairs per
cache size and policy, most of them with a miss at small caches, and each miss needs a victim. A numpy
victim costs ~10 us in call overheads alone, so a sweep of 30 replays would take many minutes; the
compiled selection costs about a microsecond per thousand resident experts, and the loop around it
nothing. The runtime calls `select` (through `EvictionPolicy.victims`, one call per eviction decision).

State (owned by `EvictionPolicy`, passed in): `stamp[i]` the recency clock value of key i (the later of
its last access and insertion; -1 = never), `count[i]` its accesses since reset, `resident[i]` whether
it is in the cache. Key i = layer * E + expert. Activation-aware eviction adds `Running`: what it has
folded in of the running sequence's counts (see `observe`).

Two entry points, one decision: `select` (the runtime's: it folds in the running EAM it is handed,
scanning all L*E counts, then chooses) and `replay` (the simulator's: it knows which layer each visit
grew, folds in only those, keeps the per-layer totals as it goes, then chooses with the same `choose`).
Both fold the same growth in the same layer order, so they take the same decisions.
"""

from __future__ import annotations

import numpy as np
from numba import njit

LRU, LFU, NEIGHBOR, ORACLE, ACTIVATION = 0, 1, 2, 3, 4
"""Policy kinds (`EvictionPolicy.kind`); Python-side constants only, never exported to another language."""

# params of ACTIVATION (float64 array); the other kinds ignore params
P_EPS, P_ALPHA, P_RECALL, P_LAYER_WEIGHTED, P_FIT, P_DISTANCE, P_RECENCY, P_FOLLOW = 0, 1, 2, 3, 4, 5, 6, 7
P_SPAN, P_TOPK, P_CARRY, P_SLOW, P_MIX, P_FIRST = 8, 9, 10, 11, 12, 13
"""With `P_SPAN` s > 0 the score is the expected distance to the next use, in layer visits: the visits
until the key's layer comes round, plus s * L per further token, a token using it with chance
p = min(1, `P_TOPK` * share), i.e. ahead + 1 + s * L * (1 / p - 1) (the fitted policy, `FittedEviction`).
`P_CARRY`: the share of the decayed counts (RECENT) a new sequence keeps from the previous one (0: none).
`P_MIX` m > 0: the sequence's share is read on two time scales, (1 - m) x the share of RECENT (decay
`P_RECENCY`) + m x that of SLOW (decay `P_SLOW`, close to 1: the sequence's long memory), each with the
collection prior; an expert the sequence used long ago keeps part of its share while recent use still
ranks first (a rare expert's return is far more likely in a sequence that used it, at any age).
`P_FIRST` w > 0: a sequence's first use of a key adds w more to its collection count (`count`, the prior),
so that with a large w the prior ranks keys by how many sequences use them rather than how often: what
foretells a key's first use in the next requests, where a large cache's misses are. A change of w
weighs the first uses counted from then on."""
NUM_PARAMS = 14
LAST, RECENT, PREVIOUS, FOLLOW, SLOW = 0, 1, 2, 3, 4
"""Rows of the running-sequence state `running` [5, L*E] of activation-aware eviction: the EAM at the
previous decision, the sequence's counts with older tokens decayed, the growth last folded in (the
latest token(s) of each layer), the share the collection's transitions predict for the next token and
the sequence's counts decayed on the slow scale (`P_SLOW`)."""
TOTAL, FOLLOWED, SLOW_TOTAL = 0, 1, 2
"""Rows of `layer_state` [3, L]: RECENT summed per layer; 1 once FOLLOW holds a prediction; SLOW summed
per layer."""
TRANSITION_PRIOR = 1.0
"""Weight (in transitions) of the collection's popularity in each row of the transition estimate."""
NEVER = np.iinfo(np.int64).max
"""next_use of a key that is never used again."""
SMALL = 8
"""Up to this many victims per call are kept in a sorted buffer during the scan; more are sorted."""


@njit(cache=True, nogil=True)
def observe_layer(layer: int, num_experts: int, eam: np.ndarray, running: np.ndarray, layer_state: np.ndarray,
                  transition: np.ndarray, seen: np.ndarray, params: np.ndarray, alphas: np.ndarray,
                  loglik: np.ndarray, layer_seen: np.ndarray) -> None:
    """Fold layer `layer`'s growth since the previous decision (`eam` over `running[LAST]`) in, once per
    decision at which the layer grew (a layer that did not grow is left alone):

    - RECENT = recency * RECENT + growth: the sequence's counts with older tokens decayed (recency 1:
      the plain counts of Algorithm 2), and SLOW the same with the decay `P_SLOW`;
    - with `P_FOLLOW`: the collection's transitions `transition[l*E + i, j]` (how often expert j served
      the token after one that expert i served, at this layer; column E holds the row sums) learn the
      pairs (previous growth -> this growth), and FOLLOW = the share they predict for the next token;
    - with the online prior fit (`P_FIT`): the growth is first scored under each prior strength of
      `alphas` (adding to `loglik`);
    - with `P_FIRST` w: a key the sequence uses for the first time (grown from 0) gains w in `seen` (the
      collection counts) and in `layer_seen` (their per-layer sums), after the prior fit has scored it.
    """
    begin, stop = layer * num_experts, (layer + 1) * num_experts
    last, recent, previous, follow = running[LAST], running[RECENT], running[PREVIOUS], running[FOLLOW]
    # what the setting reads decides which passes over the layer's E keys run: a replay pays them per
    # decision and layer, and at top-1 they cost more than the one growing key
    fit, following, first = params[P_FIT] > 0.0, params[P_FOLLOW] > 0.0, params[P_FIRST]
    grew = np.empty(num_experts if following else 0, dtype=np.int64)  # the keys that grew, ascending
    grown = 0
    for i in range(begin, stop):
        if eam[i] > last[i]:
            if following:
                grew[grown] = i
            grown += 1
            if not fit and not following:
                break  # only the prior fit and the transitions need more than whether the layer grew
    if grown == 0:
        return
    seen_total = 0.0
    if fit or following:
        for i in range(begin, stop):
            seen_total += seen[i]
    if fit:
        last_total = 0.0
        for i in range(begin, stop):
            last_total += last[i]
        # the accesses since the snapshot are in `seen` already: take them out; the collection before
        # them is smoothed so that no expert has probability 0
        seen_before = max(seen_total - grown, 0.0) + num_experts
        for i in range(begin, stop):
            tokens = eam[i] - last[i]
            if tokens <= 0.0:
                continue
            prior = (max(seen[i] - 1.0, 0.0) + 1.0) / seen_before
            for a in range(alphas.size):
                loglik[a] += tokens * np.log((last[i] + alphas[a] * prior) / (last_total + alphas[a]))
    if following:
        # the passes below run over the grown keys (one per token at top-1), not over all E
        if first > 0.0:  # before the transitions read `seen`; else in the last pass below
            for g in range(grown):
                i = grew[g]
                if last[i] == 0.0:
                    seen[i] += first
                    seen_total += first
                    layer_seen[layer] += first
        for i in range(begin, stop):
            if previous[i] > 0.0:
                row = transition[i]
                for g in range(grown):
                    row[grew[g] - begin] += 1.0
                    row[num_experts] += 1.0
        # FOLLOW[j] = mean over this growth's experts i of (T[i, j] + c * q[j]) / (T[i, :] + c), with q
        # the collection's share (uniform before any access); the first expert's term is assigned (0 + x
        # is x), and a growth of one token needs no division
        weight_total = 0.0
        for g in range(grown):
            i = grew[g]
            tokens = eam[i] - last[i]
            weight_total += tokens
            row = transition[i]
            scale = tokens / (row[num_experts] + TRANSITION_PRIOR)
            if seen_total > 0.0:
                for j in range(num_experts):
                    term = scale * (row[j] + TRANSITION_PRIOR * (seen[begin + j] / seen_total))
                    follow[begin + j] = term if g == 0 else follow[begin + j] + term
            else:
                for j in range(num_experts):
                    term = scale * (row[j] + TRANSITION_PRIOR * (1.0 / num_experts))
                    follow[begin + j] = term if g == 0 else follow[begin + j] + term
        if weight_total != 1.0:
            for j in range(begin, stop):
                follow[j] /= weight_total
        layer_state[FOLLOWED, layer] = 1.0
    decay, slow_decay = params[P_RECENCY], params[P_SLOW]
    slow = running[SLOW]
    total = 0.0
    slow_total = 0.0
    late_first = first > 0.0 and not following
    for i in range(begin, stop):
        if late_first and last[i] == 0.0 and eam[i] > 0.0:
            seen[i] += first
            layer_seen[layer] += first
        growth = max(eam[i] - last[i], 0.0)
        previous[i] = growth
        recent[i] = decay * recent[i] + growth
        slow[i] = slow_decay * slow[i] + growth
        last[i] = eam[i]
        total += recent[i]
        slow_total += slow[i]
    layer_state[TOTAL, layer] = total
    layer_state[SLOW_TOTAL, layer] = slow_total


@njit(cache=True, nogil=True)
def observe(num_layers: int, eam: np.ndarray, running: np.ndarray, layer_state: np.ndarray,
            transition: np.ndarray, seen: np.ndarray, params: np.ndarray, alphas: np.ndarray,
            loglik: np.ndarray, flags: np.ndarray, layer_seen: np.ndarray) -> None:
    """Fold the running EAM `eam` into the policy's view of the sequence, every layer in order (the
    runtime's path: it is handed the whole EAM at each decision). A shrinking count means a new sequence
    (or batch) began: the running state restarts from zero (the transitions, the collection's, stay).
    `flags[0]` = 1 once `running[LAST]` holds a snapshot; `layer_seen` [L]: `seen` summed per layer."""
    size = eam.size
    num_experts = size // num_layers
    last = running[LAST]
    fresh = flags[0] == 0
    # one pass over the [L*E] counts: a shrinking one (a new sequence), and the layers that grew since the
    # last decision (observe_layer leaves the others alone, so they are not even visited)
    grown = np.zeros(num_layers, dtype=np.bool_)
    if not fresh:
        # per layer, whether any count grew or shrank: reductions without a branch, which the compiler
        # vectorises (a scan with an early exit per key cost 5 us of a 6,144-key decision)
        for layer in range(num_layers):
            grew = False
            shrank = False
            for i in range(layer * num_experts, (layer + 1) * num_experts):
                grew |= eam[i] > last[i]
                shrank |= eam[i] < last[i]
            if shrank:
                fresh = True
                break
            grown[layer] = grew
    if fresh:
        carry = params[P_CARRY]
        recent = running[RECENT] * carry
        running[:] = 0.0
        running[RECENT] = recent
        layer_state[FOLLOWED] = 0.0
        layer_state[TOTAL] *= carry
        layer_state[SLOW_TOTAL] = 0.0
        grown[:] = True
    flags[0] = 1
    for layer in range(num_layers):
        if grown[layer]:
            observe_layer(layer, num_experts, eam, running, layer_state, transition, seen, params, alphas,
                          loglik, layer_seen)


@njit(cache=True, nogil=True)
def layer_terms(params: np.ndarray, num_layers: int, layer_state: np.ndarray, seen_total: np.ndarray,
                alphas: np.ndarray, loglik: np.ndarray, terms: np.ndarray) -> None:
    """Per layer l, the factors of share[i] = RECENT[i] * terms[0, l] + count[i] * terms[1, l] +
    FOLLOW[i] * terms[2, l] + SLOW[i] * terms[4, l], and the paper's layer weight terms[3, l] =
    1 - recall * l / L (1 when not layer-weighted). The share blends the running sequence's (decayed)
    share with the collection's, worth `alpha` counts, (RECENT[i] + alpha * count[i] / seen_total[l]) /
    (TOTAL[l] + alpha) (with `P_MIX` m > 0: (1 - m) x that + m x the same of SLOW), and that with the
    share the transitions predict, by the weight `P_FOLLOW` (once the layer has one)."""
    alpha = alphas[np.argmax(loglik)] if params[P_FIT] > 0.0 else params[P_ALPHA]
    both = params[P_MIX]
    for layer in range(num_layers):
        mix = params[P_FOLLOW] * layer_state[FOLLOWED, layer]
        total = layer_state[TOTAL, layer] + alpha
        if both > 0.0:
            slow_total = layer_state[SLOW_TOTAL, layer] + alpha
            fast = (1.0 - both) / total if total > 0.0 else 0.0
            slow = both / slow_total if slow_total > 0.0 else 0.0
            terms[0, layer] = (1.0 - mix) * fast
            terms[4, layer] = (1.0 - mix) * slow
            seen = seen_total[layer]
            terms[1, layer] = (1.0 - mix) * alpha / seen * (fast + slow) if seen > 0.0 else 0.0
        else:  # one time scale (the fixed score): the same arithmetic as before the slow one existed
            terms[0, layer] = (1.0 - mix) / total if total > 0.0 else 0.0
            terms[4, layer] = 0.0
            if total > 0.0 and seen_total[layer] > 0.0:
                terms[1, layer] = (1.0 - mix) * alpha / seen_total[layer] / total
            else:
                terms[1, layer] = 0.0
        terms[2, layer] = mix
        layered = params[P_LAYER_WEIGHTED] > 0.0
        terms[3, layer] = 1.0 - params[P_RECALL] * layer / num_layers if layered else 1.0


@njit(cache=True, nogil=True)
def select(kind: int, params: np.ndarray, num_layers: int, members: np.ndarray, stamp: np.ndarray,
           count: np.ndarray, blocked: np.ndarray, eam: np.ndarray, layer: int, next_use: np.ndarray,
           alphas: np.ndarray, loglik: np.ndarray, running: np.ndarray, layer_state: np.ndarray,
           transition: np.ndarray, flags: np.ndarray, seen_total: np.ndarray, out: np.ndarray) -> int:
    """The runtime's decision: fold the running EAM `eam` in (activation-aware only, `observe`), then
    write into `out` the keys of `members` (the resident keys, in any order) that are not blocked, with
    the lowest (score, stamp), lowest first, at most `out.size` of them; return how many (fewer only when
    fewer candidates exist). `seen_total` [L]: `count` summed per layer (kept by the caller as it counts)."""
    terms = np.zeros((5, num_layers))
    terms[3] = 1.0
    if kind == ACTIVATION:
        observe(num_layers, eam, running, layer_state, transition, count, params, alphas, loglik, flags,
                seen_total)
        layer_terms(params, num_layers, layer_state, seen_total, alphas, loglik, terms)
    return choose(kind, params, num_layers, members, stamp, count, blocked, running, layer, next_use, terms,
                  out)


@njit(cache=True, nogil=True)
def choose(kind: int, params: np.ndarray, num_layers: int, members: np.ndarray, stamp: np.ndarray,
           count: np.ndarray, blocked: np.ndarray, running: np.ndarray, layer: int, next_use: np.ndarray,
           terms: np.ndarray, out: np.ndarray) -> int:
    """The scan of `select` over prepared state. Stamps of resident keys are distinct, so the order of
    `members` does not matter."""
    # key i's layer is floor((i + 0.5) / E), exact in float64 and several times cheaper than an integer
    # division, which the scan would pay per resident key
    inv_experts = 1.0 / (stamp.size // num_layers)
    eps, by_distance = params[P_EPS], params[P_DISTANCE] > 0.0
    span, topk = params[P_SPAN] * num_layers, params[P_TOPK]
    recent, follow, slow = running[RECENT], running[FOLLOW], running[SLOW]
    wanted = out.size
    if wanted <= SMALL:
        # a few victims: keep the best `wanted` so far in a small sorted buffer, in one pass
        best_scores = np.empty(wanted)
        held = 0
        for i in members:
            if blocked[i]:
                continue
            key_layer = int((i + 0.5) * inv_experts)
            score = _score(kind, eps, by_distance, _ahead(key_layer, layer, num_layers), count[i], recent[i],
                           follow[i], slow[i], next_use[i], terms[0, key_layer], terms[1, key_layer],
                           terms[2, key_layer], terms[3, key_layer], terms[4, key_layer], span, topk)
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
            key_layer = int((i + 0.5) * inv_experts)
            candidates[found] = i
            scores[found] = _score(kind, eps, by_distance, _ahead(key_layer, layer, num_layers), count[i],
                                   recent[i], follow[i], slow[i], next_use[i], terms[0, key_layer],
                                   terms[1, key_layer], terms[2, key_layer], terms[3, key_layer],
                                   terms[4, key_layer], span, topk)
            found += 1
    wanted = min(wanted, found)
    keys = candidates[:found]
    by_stamp = np.argsort(stamp[keys], kind="mergesort")  # stamps are distinct per key: key order is moot
    order = by_stamp[np.argsort(scores[:found][by_stamp], kind="mergesort")]
    out[:wanted] = keys[order[:wanted]]
    return wanted


@njit(cache=True, nogil=True, inline="always")
def _score(kind: int, eps: float, by_distance: bool, ahead: int, count: float, recent: float, follow: float,
           slow: float, next_use: int, inv_total: float, prior_scale: float, follow_scale: float,
           weight: float, slow_scale: float, span: float, topk: float) -> float:
    """The eviction score of one key (lowest leaves first) from its own values (scalars: array
    arguments cost reference counting on every call, 30x the LRU scan); see `eviction.py`. `ahead` is
    the number of layer visits before the key's layer comes round again (0: the next layer)."""
    if kind == LRU:
        return 0.0
    if kind == LFU:
        return count
    if kind == NEIGHBOR:
        return -float(ahead)
    if kind == ORACLE:
        return -float(next_use)
    share = recent * inv_total + count * prior_scale + follow * follow_scale + slow * slow_scale + eps
    if span > 0.0:
        # minus the expected layer visits to the next use: ahead + 1, then span per token without it
        chance = min(1.0, topk * share)
        return -(ahead + 1.0 + span * (1.0 / chance - 1.0))
    if by_distance:
        # the chance of a use at the layer's next visit per layer visit the key must be held until then
        return share / (ahead + 1.0)
    return share * weight


@njit(cache=True, nogil=True, inline="always")
def _ahead(key_layer: int, layer: int, num_layers: int) -> int:
    """(key_layer - layer - 1) mod L without a division: the layer visits after `layer` before
    `key_layer` comes round again."""
    ahead = key_layer - layer - 1
    return ahead + num_layers if ahead < 0 else ahead


@njit(cache=True, nogil=True, inline="always")
def _before(score: float, stamp: int, other_score: float, other_stamp: int) -> bool:
    """Whether (score, stamp) leaves before (other_score, other_stamp): lower score, then older."""
    return score < other_score or (score == other_score and stamp < other_stamp)


@njit(cache=True, nogil=True)
def replay(kind: int, params: np.ndarray, num_layers: int, capacity: int, keys: np.ndarray,
           tokens: np.ndarray, visit_start: np.ndarray, visit_layer: np.ndarray, new_sequence: np.ndarray,
           next_visit: np.ndarray, stamp: np.ndarray, count: np.ndarray,
           resident: np.ndarray, clock: np.ndarray, alphas: np.ndarray, loglik: np.ndarray,
           running: np.ndarray, layer_state: np.ndarray, transition: np.ndarray,
           flags: np.ndarray) -> tuple[int, int]:
    """Demand-only replay of layer visits through one cache of `capacity` experts; returns (hits, misses).

    Visit v accesses `keys[visit_start[v]:visit_start[v + 1]]` (flat keys of layer `visit_layer[v]`,
    with `tokens` routed to each); `new_sequence[v]` starts a new running EAM. Per visit: the running
    EAM gains the visit's tokens; the missing keys are inserted together, after evicting as many
    victims as they need (chosen at once, the visit's keys protected, with the decision `select` would
    take on the same running EAM); then every key of the visit counts as accessed, in key order.
    `next_visit[a]` is the visit of the next access to the key of access a (NEVER if none): the
    oracle's knowledge.
    """
    size = resident.size
    num_experts = size // num_layers
    eam = np.zeros(size)
    blocked = np.zeros(size, dtype=np.bool_)
    next_use = np.full(size, NEVER, dtype=np.int64)
    out = np.empty(size, dtype=np.int64)
    members = np.flatnonzero(resident)  # the resident keys, in slots 0..occupancy-1
    occupancy = members.size
    members = np.concatenate((members, np.zeros(size - occupancy, dtype=np.int64)))
    slot = np.full(size, -1, dtype=np.int64)  # slot[key] = its position in members
    slot[members[:occupancy]] = np.arange(occupancy)
    # activation-aware: the layers grown since the last decision, and the per-layer collection totals
    grown = np.zeros(num_layers, dtype=np.bool_)
    whole = True  # the next decision folds the whole EAM in, as `select` would (a new sequence began)
    seen_total = np.zeros(num_layers)
    for key_layer in range(num_layers):
        for i in range(key_layer * num_experts, (key_layer + 1) * num_experts):
            seen_total[key_layer] += count[i]
    terms = np.zeros((5, num_layers))
    terms[3] = 1.0
    hits = 0
    misses = 0
    for v in range(visit_layer.size):
        if new_sequence[v]:
            eam[:] = 0.0
            whole = True
        start, stop = visit_start[v], visit_start[v + 1]
        layer = visit_layer[v]
        missing = 0
        for a in range(start, stop):
            key = keys[a]
            eam[key] += tokens[a]
            blocked[key] = True
            next_use[key] = next_visit[a]
            if not resident[key]:
                missing += 1
        grown[layer] = grown[layer] or stop > start
        over = occupancy + missing - capacity
        if over > 0:
            if kind == ACTIVATION:
                if whole:
                    observe(num_layers, eam, running, layer_state, transition, count, params, alphas, loglik,
                            flags, seen_total)
                    whole = False
                else:
                    for grown_layer in range(num_layers):
                        if grown[grown_layer]:
                            observe_layer(grown_layer, num_experts, eam, running, layer_state, transition,
                                          count, params, alphas, loglik, seen_total)
                grown[:] = False
                layer_terms(params, num_layers, layer_state, seen_total, alphas, loglik, terms)
            found = choose(kind, params, num_layers, members[:occupancy], stamp, count, blocked, running,
                           layer, next_use, terms, out[:over])
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
            seen_total[layer] += 1.0
            blocked[key] = False
    return hits, misses
