"""Eviction policies: activation-aware (Algorithm 2), LRU, LFU, neighbour-aware and the Belady oracle.

Every policy breaks ties by least recent use, then by key (see `EvictionPolicy`), so the victim
sequence of a replay is fully determined by its inputs.
"""

from __future__ import annotations

import numpy as np

from . import kernels
from .base import EvictionContext, EvictionPolicy, PolicyError


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
    kind = kernels.ACTIVATION
    PRIOR_TOKENS = (0.5, 2.0, 8.0, 32.0, 128.0, 512.0, 2048.0)
    """Candidate prior strengths (tokens) of the online fit."""

    def __init__(self, num_layers: int, num_experts: int, *, eps: float = 1e-4,
                 prior_tokens: float | None = None, layer_weighted: bool = True, top_k: int = 1,
                 expected_next_use: bool = False) -> None:
        super().__init__(num_layers, num_experts)
        if not eps > 0:
            raise PolicyError(f"eps must be > 0 (OffloadConfig.eps), got {eps}")
        if prior_tokens is not None and prior_tokens < 0:
            raise PolicyError(f"prior_tokens must be >= 0 or None (fitted online), got {prior_tokens}")
        self.eps = eps
        self.prior_tokens = prior_tokens
        self.layer_weighted = layer_weighted
        self.alphas = np.asarray(self.PRIOR_TOKENS, dtype=np.float64)  # [A]
        self.loglik = np.zeros(len(self.alphas))  # [A]
        self.params[kernels.P_EPS] = eps
        self.params[kernels.P_ALPHA] = prior_tokens or 0.0
        self.params[kernels.P_FIT] = prior_tokens is None
        self.params[kernels.P_LAYER_WEIGHTED] = layer_weighted
        self.params[kernels.P_RECALL] = 1.0
        # the variant measured in `moeinf bench cache` notes: score by the expected layer visits until the
        # next use, (layers until l comes round) + L * (1 / min(1, top_k * share) - 1)
        self.params[kernels.P_NEXT_USE] = expected_next_use
        self.params[kernels.P_TOP_K] = top_k

    @property
    def alpha(self) -> float:
        """The prior strength in use (tokens)."""
        if self.prior_tokens is not None:
            return self.prior_tokens
        return float(self.alphas[int(np.argmax(self.loglik))])

    def _context_arrays(self, ctx: EvictionContext) -> tuple[np.ndarray, np.ndarray]:
        if ctx.cur_eam is None:
            raise PolicyError("activation-aware eviction needs ctx.cur_eam, the running sequence's "
                              "[L, E] token counts")
        eam = np.asarray(ctx.cur_eam)
        if eam.shape != (self.num_layers, self.num_experts):
            raise PolicyError(
                f"activation-aware eviction: cur_eam has shape {eam.shape}, expected "
                f"({self.num_layers}, {self.num_experts})"
            )
        self.params[kernels.P_RECALL] = ctx.prefetch_recall
        return np.ascontiguousarray(eam, dtype=np.float64).reshape(-1), self._no_future


class LRUEviction(EvictionPolicy):
    """Least recently used: evict the key whose last access (or insertion) is oldest."""

    name = "lru"
    kind = kernels.LRU


class LFUEviction(EvictionPolicy):
    """Least frequently used: evict the key with the fewest accesses since `reset`, ties by LRU.

    Counts survive eviction (an expert popular over the whole run keeps its history when it comes
    back), so the policy tracks global expert popularity rather than in-cache frequency, which would
    evict every newly inserted expert first.
    """

    name = "lfu"
    kind = kernels.LFU


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
    kind = kernels.NEIGHBOR


class OracleEviction(EvictionPolicy):
    """Belady's MIN: evict the resident expert whose next access is farthest in the future (never
    used again = infinitely far). Optimal for a demand-filled cache; only a simulator knows the future,
    through `ctx.next_use` (flat [L*E] positions of the next access) or `ctx.future` (the accesses in
    order).
    """

    name = "oracle"
    kind = kernels.ORACLE
    needs_future = True

    def _context_arrays(self, ctx: EvictionContext) -> tuple[np.ndarray, np.ndarray]:
        if ctx.next_use is not None:
            return self._no_eam, np.asarray(ctx.next_use, dtype=np.int64)
        next_use = self._no_future.copy()
        for position, key in reversed(list(enumerate(ctx.future))):
            next_use[self.index(key)] = position
        return self._no_eam, next_use


def make_eviction(name: str, num_layers: int, num_experts: int, eps: float = 1e-4, *,
                  allow_oracle: bool = False, prefetching: bool = True) -> EvictionPolicy:
    """Build an eviction policy from its `OffloadConfig.eviction` name (`oracle` needs `allow_oracle`,
    which only a simulator should pass). `prefetching=False` says the cache has no prefetcher (see
    `ActivationAwareEviction.layer_weighted`)."""
    if name == "activation-aware":
        return ActivationAwareEviction(num_layers, num_experts, eps=eps, layer_weighted=prefetching)
    if name == "lru":
        return LRUEviction(num_layers, num_experts)
    if name == "lfu":
        return LFUEviction(num_layers, num_experts)
    if name == "neighbor":
        return NeighborEviction(num_layers, num_experts)
    if name == "oracle":
        if not allow_oracle:
            raise PolicyError("eviction 'oracle' needs the future accesses and exists only in the simulator "
                              "(moeinf.policy.simulate); choose activation-aware, lru, lfu or neighbor")
        return OracleEviction(num_layers, num_experts)
    raise PolicyError(f"unknown eviction policy {name!r}; choose one of "
                      "activation-aware, lru, lfu, neighbor (or oracle in the simulator)")
