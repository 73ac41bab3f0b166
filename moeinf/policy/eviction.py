"""Eviction policies: activation-aware (Algorithm 2), LRU, LFU, neighbour-aware and the Belady oracle.

Every policy breaks ties by least recent use, then by key (see `EvictionPolicy`), so the victim
sequence of a replay is fully determined by its inputs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from .base import EvictionContext, EvictionPolicy, Key, PolicyError


class ActivationAwareEviction(EvictionPolicy):
    """Algorithm 2: evict the resident expert with the lowest p = (share[l][e] + eps) * (1 - l / L), where
    share is the running sequence's share of layer l's tokens, cur_eam[l][e] / sum(cur_eam[l]), estimated
    with a prior: share[l][e] = (cur_eam[l][e] + a * seen[l][e] / sum(seen[l])) / (sum(cur_eam[l]) + a).

    The share keeps the experts the running sequence keeps reusing; the (1 - l / L) term keeps experts of
    early layers, which prefetching cannot bring in time. Two refinements over the paper's formula (which is
    a = 0), both measured with `moeinf bench cache`:

    - `seen` counts every access since `reset`, over all sequences (the activation matrix of the whole
      collection), weighted as `a` tokens of evidence. With the running sequence's counts alone, every
      expert scores eps at the start of a sequence, so the policy is LRU exactly when the cache is coldest
      for that sequence. How much the collection should weigh depends on the workload: on the trained zoo
      model, whose sequences each touch most experts, a = 512 beats a = 0 by 3-6 points of hit ratio; on a
      workload of strongly reused per-sequence expert sets, a = 512 loses 30 points to a = 0. So by
      default `a` is fitted online: every decision first scores the accesses since the previous one
      (the growth of cur_eam) under each candidate in `PRIOR_TOKENS`, and the candidate with the highest
      log-likelihood so far is used. A number for `prior_tokens` fixes `a`.
    - The (1 - l / L) term exists because prefetching covers later layers; it is scaled by how much
      prefetching covers, `ctx.prefetch_recall` r, as 1 - r * l / L (the runtime passes its measured
      recall; 1.0 by default, the paper's term). When prefetches serve nothing (no prefetcher, or plans
      gated by `prefetch_min_probability` on broadly routing models) the term would only starve the late
      layers: 0.327 hit ratio against LRU's 0.351 at 25% cache end to end, with no prefetch issued.
      `layer_weighted=False` drops it altogether (a cache with no prefetcher).

    `ctx.cur_eam` is required.
    """

    name = "activation-aware"
    PRIOR_TOKENS = (0.5, 2.0, 8.0, 32.0, 128.0, 512.0, 2048.0)
    """Candidate prior strengths (tokens) of the online fit."""

    def __init__(self, num_layers: int, num_experts: int, *, eps: float = 1e-4,
                 prior_tokens: float | None = None, layer_weighted: bool = True) -> None:
        super().__init__()
        if not eps > 0:
            raise PolicyError(f"eps must be > 0 (OffloadConfig.eps), got {eps}")
        if prior_tokens is not None and prior_tokens < 0:
            raise PolicyError(f"prior_tokens must be >= 0 or None (fitted online), got {prior_tokens}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.eps = eps
        self.prior_tokens = prior_tokens
        self.layer_weighted = layer_weighted
        self._seen = np.zeros((num_layers, num_experts), dtype=np.float64)  # accesses since reset
        self._alphas = np.asarray(self.PRIOR_TOKENS, dtype=np.float64)  # [A]
        self._loglik = np.zeros(len(self._alphas))  # [A]
        self._last: np.ndarray | None = None  # cur_eam at the previous decision

    @property
    def alpha(self) -> float:
        """The prior strength in use (tokens)."""
        if self.prior_tokens is not None:
            return self.prior_tokens
        return float(self._alphas[int(np.argmax(self._loglik))])

    def on_access(self, key: Key) -> None:
        super().on_access(key)
        self._seen[key] += 1.0

    def reset(self) -> None:
        super().reset()
        self._seen.fill(0.0)
        self._loglik.fill(0.0)
        self._last = None

    def victim(self, resident: Sequence[Key], ctx: EvictionContext) -> Key:
        candidates = self._candidates(resident, ctx)
        if ctx.cur_eam is None:
            raise PolicyError("activation-aware eviction needs ctx.cur_eam, the running sequence's "
                              "[L, E] token counts")
        eam = np.asarray(ctx.cur_eam, dtype=np.float64)
        if eam.shape != (self.num_layers, self.num_experts):
            raise PolicyError(
                f"activation-aware eviction: cur_eam has shape {eam.shape}, expected "
                f"({self.num_layers}, {self.num_experts})"
            )
        if self.prior_tokens is None:
            self._fit(eam)
        alpha = self.alpha
        index = np.array(candidates, dtype=np.int64)  # [C, 2]
        layers, experts = index[:, 0], index[:, 1]
        counts = eam[layers, experts] + alpha * _shares(self._seen, layers, experts)  # [C]
        totals = eam.sum(axis=1)[layers] + alpha  # [C]
        scores = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0) + self.eps
        if self.layer_weighted:
            scores *= 1.0 - ctx.prefetch_recall * layers / self.num_layers
        return self._lowest(candidates, scores)

    def _fit(self, eam: np.ndarray) -> None:
        """Score the tokens routed since the previous decision under every candidate prior strength."""
        last = self._last
        if last is None or (eam < last).any():
            last = np.zeros_like(eam)  # a new sequence (or batch) began
        self._last = eam.copy()
        layers, experts = np.nonzero(eam > last)
        if layers.size == 0:
            return
        tokens = (eam - last)[layers, experts]  # [K]
        # the collection as it was before these accesses, smoothed so that no expert has probability 0
        seen = np.maximum(self._seen - (eam > last), 0.0)
        prior = (seen[layers, experts] + 1.0) / (seen.sum(axis=1)[layers] + self.num_experts)  # [K]
        before = last[layers, experts]  # [K]
        total = last.sum(axis=1)[layers]  # [K]
        alphas = self._alphas[:, None]  # [A, 1]
        prob = (before + alphas * prior) / (total + alphas)  # [A, K]
        self._loglik += (tokens * np.log(prob)).sum(axis=1)


def _shares(eam: np.ndarray, layers: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """eam[l][e] / sum(eam[l]) for each (layer, expert) pair (0 for a layer with no count): [C]."""
    totals = eam.sum(axis=1)[layers]  # [C]
    counts = eam[layers, experts]  # [C]
    return np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)


class LRUEviction(EvictionPolicy):
    """Least recently used: evict the key whose last access (or insertion) is oldest."""

    name = "lru"

    def victim(self, resident: Sequence[Key], ctx: EvictionContext) -> Key:
        candidates = self._candidates(resident, ctx)
        return self._lowest(candidates, [0] * len(candidates))


class LFUEviction(EvictionPolicy):
    """Least frequently used: evict the key with the fewest accesses since `reset`, ties by LRU.

    Counts survive eviction (an expert popular over the whole run keeps its history when it comes
    back), so the policy tracks global expert popularity rather than in-cache frequency, which would
    evict every newly inserted expert first.
    """

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._count: Counter[Key] = Counter()

    def on_access(self, key: Key) -> None:
        super().on_access(key)
        self._count[key] += 1

    def reset(self) -> None:
        super().reset()
        self._count.clear()

    def victim(self, resident: Sequence[Key], ctx: EvictionContext) -> Key:
        candidates = self._candidates(resident, ctx)
        return self._lowest(candidates, [self._count[key] for key in candidates])


class NeighborEviction(EvictionPolicy):
    """Neighbour-aware: keep the experts of the layers the computation reaches next.

    A forward pass visits MoE layers 0..L-1 in order, then starts again for the next token. After the
    router of layer `c = ctx.layer`, the layer `l` is next needed after
    `ahead(l) = (l - c - 1) mod L` more layers: layer c+1 comes first (0), the current layer itself and
    then the layers the computation just left come last (L-1, L-2, ...). The victim is the unprotected
    expert with the largest `ahead`, i.e. from the layer just computed, then the one before it; inside a
    layer the least recently used goes first. This is Belady's rule under the assumption that every
    expert of a layer is reused at that layer's next visit, the layer-order idea behind "Least-Stale"
    eviction (Hoang et al., "SpecMD", 2026): MoE expert accesses follow the layer order far more than
    they follow recency.
    """

    name = "neighbor"

    def __init__(self, num_layers: int) -> None:
        super().__init__()
        if num_layers < 1:
            raise PolicyError(f"num_layers must be >= 1, got {num_layers}")
        self.num_layers = num_layers

    def victim(self, resident: Sequence[Key], ctx: EvictionContext) -> Key:
        candidates = self._candidates(resident, ctx)
        # lowest score leaves first: the farthest layer ahead has the most negative score
        scores = [-((layer - ctx.layer - 1) % self.num_layers) for layer, _ in candidates]
        return self._lowest(candidates, scores)


class OracleEviction(EvictionPolicy):
    """Belady's MIN: evict the resident expert whose next access is farthest in the future (never
    used again = infinitely far). Optimal for a demand-filled cache; only a simulator knows the future,
    through `ctx.next_use` (key -> position of the next access) or `ctx.future` (the accesses in order).
    """

    name = "oracle"
    needs_future = True

    def victim(self, resident: Sequence[Key], ctx: EvictionContext) -> Key:
        candidates = self._candidates(resident, ctx)
        next_use = ctx.next_use
        if next_use is None:
            next_use = {}
            for position, key in enumerate(ctx.future):
                next_use.setdefault(key, position)
        never = float("inf")
        # the farthest next use leaves first: negate so that the lowest score is the victim
        return self._lowest(candidates, [-next_use.get(key, never) for key in candidates])


def make_eviction(name: str, num_layers: int, num_experts: int, eps: float = 1e-4, *,
                  allow_oracle: bool = False, prefetching: bool = True) -> EvictionPolicy:
    """Build an eviction policy from its `OffloadConfig.eviction` name (`oracle` needs `allow_oracle`,
    which only a simulator should pass). `prefetching=False` says the cache has no prefetcher (see
    `ActivationAwareEviction.layer_weighted`)."""
    if name == "activation-aware":
        return ActivationAwareEviction(num_layers, num_experts, eps=eps, layer_weighted=prefetching)
    if name == "lru":
        return LRUEviction()
    if name == "lfu":
        return LFUEviction()
    if name == "neighbor":
        return NeighborEviction(num_layers)
    if name == "oracle":
        if not allow_oracle:
            raise PolicyError("eviction 'oracle' needs the future accesses and exists only in the simulator "
                              "(moeinf.policy.simulate); choose activation-aware, lru, lfu or neighbor")
        return OracleEviction()
    raise PolicyError(f"unknown eviction policy {name!r}; choose one of "
                      "activation-aware, lru, lfu, neighbor (or oracle in the simulator)")
