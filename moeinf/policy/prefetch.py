"""Prefetch policies: activation-aware (Algorithm 1), sequence top-k, traced top-k and none.

All of them plan for the layers after the current one (within `lookahead`, 0 = all later layers) and
score an expert of layer l with the same shape of priority, (share + eps) * (1 - l / L), where the
share comes from a different source: the matched EAM, the running sequence, or a trace dataset.
Priorities are therefore comparable across policies and always order nearer layers first when the
shares are equal.
"""

from __future__ import annotations

import numpy as np

from .base import Key, PolicyError, PrefetchPolicy, layer_priorities, ranked
from .lookahead import LOOKAHEAD_POLICIES, LookaheadPrefetch


class ActivationAwarePrefetch(PrefetchPolicy):
    """Algorithm 1: after the router of `layer`, every expert e of every later layer l gets
    p = (P[l][e] / sum(P[l]) + eps) * (1 - l / L), P being the matched EAM.

    Planned: the experts with P[l][e] > 0, highest priority first; the runtime fetches them in that
    order as far as its budget goes. With `include_unseen=True` the experts with P[l][e] == 0 are
    listed too, behind them in their layer, with the eps-only priority. No prediction (`matched` is
    None, e.g. an empty EAMC) plans nothing.

    `min_probability` drops the experts whose predicted chance of serving a token, `top_k * P[l][e] /
    sum(P[l])` (the shares of a layer sum to 1 and each token takes `top_k` experts), is below it. When
    reads are the bottleneck, as from an SSD that moves fewer experts per layer time than a token needs,
    every prefetch that is not used delays the demand reads behind it: measured end to end with trained
    routing (`moeinf bench e2e`), planning every expert with P > 0 gave a prefetch precision of 0.07-0.10
    and a per-token latency 1.2-2.1x that of fetching on demand.
    """

    name = "activation-aware"

    def __init__(self, num_layers: int, num_experts: int, *, eps: float = 1e-4, lookahead: int = 0,
                 refine: bool = True, include_unseen: bool = False, top_k: int = 1,
                 min_probability: float = 0.0) -> None:
        super().__init__(num_layers, num_experts, eps=eps, lookahead=lookahead, refine=refine)
        if top_k < 1:
            raise PolicyError(f"activation-aware prefetch: top_k must be >= 1, got {top_k}")
        if not 0.0 <= min_probability <= 1.0:
            raise PolicyError(f"min_probability must lie in [0, 1] (OffloadConfig.prefetch_min_probability), "
                              f"got {min_probability}")
        self.include_unseen = include_unseen and min_probability == 0.0
        self.top_k = top_k
        self.min_probability = min_probability

    def plan(self, layer: int, cur_eam: np.ndarray, matched: np.ndarray | None) -> list[tuple[Key, float]]:
        if matched is None:
            return []
        predicted = self._check("matched", matched)  # [L, E]
        scores = layer_priorities(predicted, self.eps)  # [L, E]
        totals = predicted.sum(axis=1, keepdims=True)  # [L, 1]
        chance = self.top_k * np.divide(predicted, totals, out=np.zeros_like(predicted), where=totals > 0)
        likely = (predicted > 0) & (chance >= self.min_probability)  # [L, E]
        entries: list[tuple[Key, float]] = []
        for later in self._later_layers(layer):
            experts = range(self.num_experts) if self.include_unseen else np.flatnonzero(likely[later])
            entries.extend(((later, int(e)), float(scores[later, e])) for e in experts)
        return ranked(entries)


class TopKPrefetch(PrefetchPolicy):
    """Sequence top-k, the baseline that needs no matched EAM: for each later layer l, the `k` experts
    this sequence routed the most tokens to at layer l so far (`cur_eam[l]`).

    Ties, including a layer this sequence has not reached yet (its first forward pass, the prefill),
    are broken by the counts of the current layer, i.e. "the same experts as now", then by expert id;
    experts with no count in either row are not planned. Priority: (cur_eam[l][e] / sum(cur_eam[l]) +
    eps) * (1 - l / L), like Algorithm 1 with the sequence's own history as the prediction.
    """

    name = "topk"

    def __init__(self, num_layers: int, num_experts: int, *, k: int, eps: float = 1e-4, lookahead: int = 0,
                 refine: bool = True) -> None:
        super().__init__(num_layers, num_experts, eps=eps, lookahead=lookahead, refine=refine)
        if k < 1:
            raise PolicyError(f"topk prefetch: k must be >= 1 (the model's experts per token), got {k}")
        self.k = k

    def plan(self, layer: int, cur_eam: np.ndarray, matched: np.ndarray | None) -> list[tuple[Key, float]]:
        counts = self._check("cur_eam", cur_eam)  # [L, E]
        scores = layer_priorities(counts, self.eps)  # [L, E]
        now = counts[layer]  # [E]
        entries: list[tuple[Key, float]] = []
        for later in self._later_layers(layer):
            # sort by (later-layer count desc, current-layer count desc, expert id asc)
            order = np.lexsort((np.arange(self.num_experts), -now, -counts[later]))
            chosen = [int(e) for e in order[: self.k] if counts[later, e] > 0 or now[e] > 0]
            entries.extend(((later, e), float(scores[later, e])) for e in chosen)
        return ranked(entries)


class TracedTopKPrefetch(PrefetchPolicy):
    """Traced top-k: for each later layer, the `k` experts most popular over a trace dataset
    (`popularity[l][e]` = tokens routed to (l, e), summed over the EAMs of the EAMC; see
    `popularity`). The plan does not depend on the running sequence. Priority: (popularity share +
    eps) * (1 - l / L).
    """

    name = "traced-topk"

    def __init__(self, num_layers: int, num_experts: int, *, k: int, popularity: np.ndarray,
                 eps: float = 1e-4, lookahead: int = 0, refine: bool = True) -> None:
        super().__init__(num_layers, num_experts, eps=eps, lookahead=lookahead, refine=refine)
        if k < 1:
            raise PolicyError(f"traced-topk prefetch: k must be >= 1, got {k}")
        self.k = k
        self.popularity = self._check("popularity", popularity)
        self._scores = layer_priorities(self.popularity, eps)  # [L, E]
        # per layer: experts by popularity desc, then id asc; only experts seen in the traces
        self._top: list[list[int]] = []
        for row in self.popularity:
            order = np.lexsort((np.arange(num_experts), -row))
            self._top.append([int(e) for e in order[:k] if row[e] > 0])

    def plan(self, layer: int, cur_eam: np.ndarray, matched: np.ndarray | None) -> list[tuple[Key, float]]:
        entries = [((later, e), float(self._scores[later, e]))
                   for later in self._later_layers(layer) for e in self._top[later]]
        return ranked(entries)


class NoPrefetch(PrefetchPolicy):
    """Fetch on demand only."""

    name = "none"

    def should_plan(self, layer: int) -> bool:
        # No plan to make, so no EAMC matching for one either (it would cost the on-demand LRU baseline
        # milliseconds per decoded token).
        return False

    def plan(self, layer: int, cur_eam: np.ndarray, matched: np.ndarray | None) -> list[tuple[Key, float]]:
        return []


def popularity(eams: np.ndarray | list[np.ndarray]) -> np.ndarray:
    """[L, E] token counts summed over a collection of EAMs ([N, L, E] or a list of [L, E])."""
    stacked = np.asarray(eams, dtype=np.float64)
    if stacked.ndim != 3:
        raise PolicyError(f"popularity: expected EAMs of shape [N, L, E], got {stacked.shape}")
    return stacked.sum(axis=0)


def make_prefetch(name: str, num_layers: int, num_experts: int, eps: float = 1e-4, *, top_k: int = 1,
                  lookahead: int = 0, refine: bool = True, popularity: np.ndarray | None = None,
                  include_unseen: bool = False, min_probability: float = 0.0,
                  depth: int = 1) -> PrefetchPolicy:
    """Build a prefetch policy from its `OffloadConfig.prefetch` name.

    `top_k` is the k of `topk` and `traced-topk` (the model's experts per token is the natural
    choice); `popularity` ([L, E], see `popularity()`) is required by `traced-topk`; `lookahead` is
    `OffloadConfig.prefetch_layers`; `depth` is `OffloadConfig.lookahead_depth` (lookahead, hybrid: see
    `moeinf.policy.lookahead`, whose prior is `popularity`).
    """
    if name in LOOKAHEAD_POLICIES:
        return LookaheadPrefetch(num_layers, num_experts, depth=depth, top_k=top_k, eps=eps,
                                 min_probability=min_probability, hybrid=name == "hybrid", prior=popularity)
    common = {"eps": eps, "lookahead": lookahead, "refine": refine}
    if name == "activation-aware":
        return ActivationAwarePrefetch(num_layers, num_experts, include_unseen=include_unseen, top_k=top_k,
                                       min_probability=min_probability, **common)
    if name == "topk":
        return TopKPrefetch(num_layers, num_experts, k=top_k, **common)
    if name == "traced-topk":
        if popularity is None:
            raise PolicyError("prefetch 'traced-topk' needs the expert popularity of a trace dataset: pass "
                              "popularity=moeinf.policy.popularity(eams) (e.g. the EAMs of the EAMC), "
                              "or choose prefetch 'activation-aware' or 'topk'")
        return TracedTopKPrefetch(num_layers, num_experts, k=top_k, popularity=popularity, **common)
    if name == "none":
        return NoPrefetch(num_layers, num_experts, **common)
    raise PolicyError(f"unknown prefetch policy {name!r}; choose one of "
                      "hybrid, lookahead, activation-aware, topk, traced-topk, none")
