"""Look-ahead prefetch: plan the next layers from what a predictor says about the tokens in flight.

While layer `l` computes, a predictor (the routers of later layers run on layer l's router input, or a
learned map; see `moeinf/runtime/lookahead.py`) gives, for each layer `l+1..l+d`, the chance that each
expert serves a token of the running batch. This module turns those chances into a plan and keeps the
plan within what the drive can deliver; it is pure (numpy arrays in, keys and priorities out).

`Transitions` is a predictor that needs no hidden state: the experts layer l routed a token to name, through
counts on traced routing, the experts layers l+1..l+d route it to (on real routing far better than the
sequence's own EAM or popularity: docs/benchmarks.md). It serves where no router can run ahead: replayed
routing, families whose router needs its block's state.

- `lookahead` plans only the predicted layers (past the last layer, the next pass's first ones, when the
  predictor wraps: `moeinf.trace.lookahead_fit.fit(wrap=True)`, not the default).
- `hybrid` also plans the layers past the predictor's depth, and the first layers of the next forward
  pass (after the last layer, the next token's layer 0, 1, ...), from the running sequence's own EAM, the
  EAM matched in the EAMC and the collection prior (the EAMC's popularity), averaged; the predictor's
  chance always wins where it exists.

Priorities follow deadlines: an expert needed `j` layers from now outranks every expert needed later,
and within a layer a higher chance ranks first (`priority`). `deliverable` then cuts the plan to the
reads the drive can start before their layer begins, given the measured reads per layer of compute.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .base import Key, PolicyError, PrefetchPolicy, ranked

LOOKAHEAD_POLICIES = ("lookahead", "hybrid")


def any_token_chance(probabilities: np.ndarray) -> np.ndarray:
    """[E] chance that an expert serves at least one of the tokens, from per-token chances [T, E]."""
    p = np.clip(np.asarray(probabilities, dtype=np.float64), 0.0, 1.0)  # [T, E]
    return 1.0 - np.prod(1.0 - p, axis=0)


def layer_distance(layer: int, later: int, num_layers: int) -> int:
    """MoE layers from `layer` until `later` runs: `later` of this pass, or of the next one if <= layer."""
    return later - layer if later > layer else later + num_layers - layer


def priority(distance: int, chance: float, span: int, eps: float) -> float:
    """Deadline first, then chance: in (0, 1] for 1 <= distance <= span and chance in [0, 1]."""
    return ((span - distance) + chance + eps) / (span + 1 + eps)


class LookaheadPrefetch(PrefetchPolicy):
    """Prefetch from per-layer chances predicted for the layers ahead (`ahead`, [d, E] for l+1..l+d).

    `plan(layer, cur_eam, matched, ahead)` lists the experts whose chance reaches `min_probability`,
    ordered by `priority`. `hybrid=True` adds the layers the prediction does not cover: later layers of
    this pass and, from the last layers, the first layers of the next pass (`wrap` layers at most),
    scored `top_k` x the average share of the expert in the sequence's EAM, the matched EAM and the
    collection prior `prior` [L, E] (those that exist and have counts in that layer).
    """

    def __init__(self, num_layers: int, num_experts: int, *, depth: int, top_k: int,
                 min_probability: float, hybrid: bool = False, prior: np.ndarray | None = None,
                 eps: float = 1e-4, wrap: int | None = None) -> None:
        super().__init__(num_layers, num_experts, eps=eps, lookahead=depth, refine=True)
        if depth < 1:
            raise PolicyError(f"lookahead prefetch: depth must be >= 1 (OffloadConfig.lookahead_depth), "
                              f"got {depth}")
        if top_k < 1:
            raise PolicyError(f"lookahead prefetch: top_k must be >= 1, got {top_k}")
        if not 0.0 <= min_probability <= 1.0:
            raise PolicyError(f"min_probability must lie in [0, 1] (OffloadConfig.prefetch_min_probability), "
                              f"got {min_probability}")
        self.name = "hybrid" if hybrid else "lookahead"
        self.depth = depth
        self.top_k = top_k
        self.min_probability = min_probability
        self.hybrid = hybrid
        self.prior = None if prior is None else self._check("prior", prior)
        self.wrap = depth if wrap is None else wrap
        self.span = num_layers if hybrid else depth
        """The farthest distance planned: a whole pass ahead for hybrid, the depth for lookahead."""

    def distance(self, layer: int, later: int) -> int:
        return layer_distance(layer, later, self.num_layers)

    def plan(self, layer: int, cur_eam: np.ndarray, matched: np.ndarray | None,
             ahead: np.ndarray | None = None) -> list[tuple[Key, float]]:
        return self.plan_batch(layer, self._check("cur_eam", cur_eam)[None], [matched], ahead)

    def plan_batch(self, layer: int, eams: np.ndarray, matched: list[np.ndarray | None],
                   ahead: np.ndarray | None = None) -> list[tuple[Key, float]]:
        """The merged plan of a batch: each row's EAM `eams` [B, L, E] and matched EAM `matched[b]`, the
        batch's look-ahead chances `ahead` [d, E]. Equal to planning each row and keeping the highest
        priority per key (as `priority` rises with the chance at a given distance, that is the priority
        of the highest chance over the rows), in one pass over the batch."""
        chances = np.full((self.num_layers, self.num_experts), np.nan)  # [L, E], NaN = no estimate
        if ahead is not None:
            rows = np.asarray(ahead, dtype=np.float64)[: self.num_layers]  # [d, E]
            # row i is layer layer+1+i; past the last layer, the next pass's (a predictor that wraps)
            chances[(layer + 1 + np.arange(rows.shape[0])) % self.num_layers] = rows
        if self.hybrid:
            estimate = self._sequence_estimate(np.asarray(eams, dtype=np.float64), matched)  # [B, L, E]
            # the highest estimate over the rows that have one (NaN where none has)
            best = np.where(np.isnan(estimate), -np.inf, estimate).max(axis=0)
            chances = np.where(np.isnan(chances), np.where(best == -np.inf, np.nan, best), chances)
        planned = np.asarray(self._planned_layers(layer), dtype=np.int64)
        if planned.size == 0:
            return []
        rows = chances[planned]  # [P, E]
        floor = max(self.min_probability, self.eps)
        picked_row, experts = np.nonzero(rows >= floor)  # NaN compares False
        later = planned[picked_row]
        distance = np.where(later > layer, later - layer, later + self.num_layers - layer)
        # `priority`, elementwise in the same order of operations
        scores = ((self.span - distance) + rows[picked_row, experts] + self.eps) / (self.span + 1 + self.eps)
        order = np.lexsort((experts, later, -scores))  # priority down, then key (as `ranked`)
        return [((int(later[i]), int(experts[i])), float(scores[i])) for i in order]

    def _planned_layers(self, layer: int) -> list[int]:
        later = list(range(layer + 1, self.num_layers if self.hybrid else
                           min(self.num_layers, layer + 1 + self.depth)))
        # the next pass's first layers, as many as are within `wrap` (hybrid) or `depth` layers of this
        # one (without an estimate for them, lookahead plans nothing there)
        reach = layer + (self.wrap if self.hybrid else self.depth) - self.num_layers
        later.extend(range(min(reach + 1, layer + 1)))
        return later

    def _sequence_estimate(self, eams: np.ndarray, matched: list[np.ndarray | None]) -> np.ndarray:
        """[B, L, E] top_k x the mean share over each row's EAM, its matched EAM and the prior (NaN in a
        layer where none of them has counts)."""
        total = np.zeros(eams.shape)
        count = np.zeros((*eams.shape[:2], 1))

        def add(counts: np.ndarray, into: tuple[slice | int, ...] = (slice(None),)) -> None:
            sums = counts.sum(axis=-1, keepdims=True)  # [..., L, 1]
            total[into] += np.divide(counts, sums, out=np.zeros_like(counts), where=sums > 0)
            count[into] += sums > 0

        add(eams)
        for b, rows in enumerate(matched):
            if rows is not None:
                add(self._check("matched", rows), (b,))
        if self.prior is not None:
            add(self.prior)
        mean = np.divide(total, count, out=np.full_like(total, np.nan), where=count > 0)
        return np.minimum(self.top_k * mean, 1.0)


def deliverable(plan: list[tuple[Key, float]], distances: list[int], resident: Collection[Key],
                reads_per_layer: float) -> list[tuple[Key, float]]:
    """The entries of `plan` whose read the drive can start before their layer begins.

    Entries are taken in deadline order (`distances[i]` layers ahead, then priority). A read that is not
    resident costs one read; it is kept when the reads kept before it (`n`) take less than its
    distance's worth of compute: `n < distance * reads_per_layer`, with `reads_per_layer` = measured
    bandwidth x per-layer compute time / expert bytes. Resident entries cost nothing and are kept. The
    current layer's demand misses delay the drive and the compute alike, so they do not enter the sum;
    a demand read preempts a queued prefetch between chunks, so a kept prefetch delays it by one chunk
    at most.
    """
    if len(distances) != len(plan):
        raise PolicyError(f"deliverable: {len(plan)} plan entries but {len(distances)} distances")
    if not reads_per_layer >= 0 or math.isinf(reads_per_layer):
        raise PolicyError(f"deliverable: reads_per_layer must be finite and >= 0, got {reads_per_layer}")
    order = sorted(range(len(plan)), key=lambda i: (distances[i], -plan[i][1], plan[i][0]))
    kept: list[tuple[Key, float]] = []
    reads = 0
    for i in order:
        key, _ = plan[i]
        if key in resident:
            kept.append(plan[i])
        elif reads < distances[i] * reads_per_layer:
            kept.append(plan[i])
            reads += 1
    return ranked(kept)


@dataclass(frozen=True)
class Transitions:
    """Expert-to-expert transitions between MoE layers, counted on traced routing.

    `cond` [D, L, E, E]: `cond[d - 1, l, e, f]` is the share of the tokens routed to expert e at layer l
    that layer l + d routed to f (0 where e was never routed). A token's raw chance for f at l + d is the
    mean of that share over its k experts of layer l; `calibration` [B] maps the raw chance, in B equal
    bins of [0, 1], to how often f was in fact routed there in the traces it was fit on (non-decreasing),
    so that the planner's `min_probability` means what it says.

    With `prior` [L, E] (each layer's routed share) and `joint` [S - 1, B], the token's earlier layers of
    the same pass join in (`chances(earlier=...)`): layer l + d is predicted from layers l, l - 1, ...,
    l - n + 1 (n <= S, each within the depth D of l + d), naive Bayes over them: the sum of the log raw
    chances less (n - 1) x the log prior, as a softmax over the experts x k, calibrated by `joint[n - 2]`.
    One layer's routing is a weak witness of the next; what joining gains on real routing is in
    docs/benchmarks.md ("A model bigger than the machine").
    """

    cond: np.ndarray
    calibration: np.ndarray
    prior: np.ndarray | None = None
    joint: np.ndarray | None = None

    @property
    def sources(self) -> int:
        """The most layers of a token whose routing one prediction combines (1 without `joint`)."""
        return 1 if self.joint is None or self.prior is None else 1 + int(self.joint.shape[0])

    @property
    def depth(self) -> int:
        return int(self.cond.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.cond.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.cond.shape[2])

    @classmethod
    def fit(cls, routings: Iterable[np.ndarray], num_layers: int, num_experts: int, depth: int,
            bins: int = 20, calibrate_tokens: int = 4096, sources: int = 1) -> Transitions:
        """Count the transitions of `routings` (per request, expert ids [T, L, k] of its positions in
        order; ids outside 0..E-1 are ignored) up to `depth` layers ahead, then calibrate on the first
        `calibrate_tokens` positions of them (B rates need far fewer than the counts); with `sources` > 1,
        also the predictions from up to that many layers of a token (`joint`)."""
        if sources < 1:
            raise PolicyError(f"transitions: sources must be >= 1, got {sources}")
        if depth < 1 or num_layers < 2:
            raise PolicyError(f"transitions: need depth >= 1 and >= 2 MoE layers, got depth {depth}, "
                              f"{num_layers} layers")
        depth = min(depth, num_layers - 1)
        pairs = np.zeros((depth, num_layers, num_experts, num_experts), dtype=np.float32)  # exact to 2^24
        routed = np.zeros((num_layers, num_experts), dtype=np.float32)
        calibrating, left = [], calibrate_tokens  # the first positions' [T, L, E], kept for the calibration
        for routing in routings:
            onehot = _onehot(np.asarray(routing), num_layers, num_experts)  # [T, L, E]
            if left > 0:
                calibrating.append(onehot[:left])
                left -= onehot.shape[0]
            routed += onehot.sum(axis=0)
            by_layer = onehot.transpose(1, 2, 0)  # [L, E, T]
            for d in range(1, depth + 1):
                later = onehot[:, d:].transpose(1, 0, 2)  # [L - d, T, E]
                pairs[d - 1, : num_layers - d] += by_layer[: num_layers - d] @ later
        cond = pairs / np.maximum(routed, 1.0)[None, :, :, None]
        hits, seen = np.zeros(bins), np.zeros(bins)
        for onehot in calibrating:
            if onehot.shape[0] == 0:
                continue
            for d in range(1, depth + 1):
                raw = _raw_chances(cond[d - 1, : num_layers - d], onehot[:, : num_layers - d])  # [T, L-d, E]
                binned = _bin(raw, bins)
                truth = onehot[:, d:] > 0
                seen += np.bincount(binned.ravel(), minlength=bins)
                hits += np.bincount(binned[truth], minlength=bins)
        # empty bins take their neighbours' rate; the map is made non-decreasing in the raw chance
        centres = (np.arange(bins) + 0.5) / bins
        rate = np.divide(hits, seen, out=centres.copy(), where=seen > 0)
        calibration = np.maximum.accumulate(rate).astype(np.float32)
        sources = min(sources, depth, num_layers - 1)
        if sources < 2:
            return cls(cond, calibration)
        prior = (routed / np.maximum(routed.sum(axis=1, keepdims=True), 1.0)).astype(np.float32)
        hits, seen = np.zeros((sources - 1, bins)), np.zeros((sources - 1, bins))
        for onehot in calibrating:
            for d in range(1, depth + 1):
                for layer in range(1, num_layers - d):  # layer 0 has no earlier layer to join
                    joined, n = _joint_chances(cond, prior, layer, d, onehot[:, layer::-1].transpose(1, 0, 2),
                                               sources)
                    if n < 2:
                        continue
                    binned = _bin(joined, bins)
                    seen[n - 2] += np.bincount(binned.ravel(), minlength=bins)
                    hits[n - 2] += np.bincount(binned[onehot[:, layer + d] > 0], minlength=bins)
        rate = np.divide(hits, seen, out=np.tile(centres, (sources - 1, 1)), where=seen > 0)
        return cls(cond, calibration, prior, np.maximum.accumulate(rate, axis=1).astype(np.float32))

    def chances(self, layer: int, routed: np.ndarray, earlier: Sequence[np.ndarray] = (),
                ahead: int | None = None) -> np.ndarray | None:
        """[D', T, E] calibrated chances of layers layer+1..layer+D' (D' = the depth within the model, at
        most `ahead`) for tokens routed at `layer` to `routed` [T, k]; None past the last layer.
        `earlier[j]` [T, k] is the same tokens' routing at layer - 1 - j (`sources` > 1 joins them in)."""
        ahead = min(self.depth if ahead is None else ahead, self.depth, self.num_layers - 1 - layer)
        if ahead < 1 or not 0 <= layer < self.num_layers:
            return None
        routed = np.asarray(routed)
        rows = [routed]
        for ids in earlier[: min(self.sources - 1, layer)]:
            if np.shape(ids) != routed.shape:  # not the same tokens: the layers before it are not either
                break
            rows.append(np.asarray(ids))
        onehots = _onehot(np.stack(rows, axis=1), len(rows), self.num_experts).transpose(1, 0, 2)  # [n, T, E]
        out = []
        for d in range(1, ahead + 1):
            joined, n = _joint_chances(self.cond, self.prior, layer, d, onehots, self.sources)
            if n < 2:
                raw = _raw_chances(self.cond[d - 1, layer][None], onehots[0][:, None])[:, 0]  # [T, E]
                out.append(self.calibration[_bin(raw, self.calibration.shape[0])])
            else:
                out.append(self.joint[n - 2][_bin(joined, self.joint.shape[1])])
        return np.stack(out)


def _onehot(ids: np.ndarray, num_layers: int, num_experts: int) -> np.ndarray:
    """[T, L, E] 0/1 from expert ids [T, L, k] (ids outside 0..E-1 left out)."""
    out = np.zeros((ids.shape[0], num_layers, num_experts), dtype=np.float32)
    valid = (ids >= 0) & (ids < num_experts)
    t, layer, _ = np.nonzero(valid)
    out[t, layer, ids[valid]] = 1.0
    return out


JOINED = 3
"""Layers of a token that `moeinf trace` (and `bench scale`'s replayed rows) fit transitions to join: a
prediction d layers ahead then needs counts d + 2 layers ahead (docs/benchmarks.md, "A model bigger than
the machine")."""

JOINT_FLOOR = 1e-3
"""Added to each raw chance and prior before their logs: an expert no witness ever saw follow keeps a
small chance instead of minus infinity."""


def _bin(chances: np.ndarray, bins: int) -> np.ndarray:
    """The bin of each chance in [0, 1] among `bins` equal ones (1 in the last)."""
    return np.minimum((chances * bins).astype(np.int64), bins - 1)


def _joint_chances(cond: np.ndarray, prior: np.ndarray | None, layer: int, d: int, onehots: np.ndarray,
                   sources: int) -> tuple[np.ndarray, int]:
    """([T, E] chances of layer + d, n) from the tokens' routing at layers layer, layer - 1, ... (`onehots`
    [m, T, E], in that order), naive Bayes over the n <= `sources` of them whose distance to layer + d is
    within the depth of `cond`: softmax(sum of log raw chances - (n - 1) log prior) x k, at most 1. With
    n < 2 (or no prior) nothing is joined: (empty, n)."""
    depth = cond.shape[0]
    n = min(sources, onehots.shape[0], depth - d + 1, layer + 1)
    if n < 2 or prior is None:
        return np.zeros(0), min(n, 1)
    logs = np.log(prior[layer + d] + JOINT_FLOOR) * -(n - 1)  # [E]
    for j in range(n):
        raw = _raw_chances(cond[d + j - 1, layer - j][None], onehots[j][:, None])[:, 0]  # [T, E]
        logs = logs + np.log(raw + JOINT_FLOOR)
    logs -= logs.max(axis=1, keepdims=True)
    weights = np.exp(logs)
    k = onehots[0].sum(axis=1, keepdims=True)  # [T, 1]
    return np.minimum(weights / weights.sum(axis=1, keepdims=True) * k, 1.0), n


def _raw_chances(cond: np.ndarray, onehot: np.ndarray) -> np.ndarray:
    """[T, L, E]: per token and layer, the mean of `cond` [L, E, E] over the token's experts (`onehot`
    [T, L, E]); 0 for a token routed nowhere."""
    k = onehot.sum(axis=2, keepdims=True)  # [T, L, 1]
    return (onehot.transpose(1, 0, 2) @ cond).transpose(1, 0, 2) / np.maximum(k, 1.0)
