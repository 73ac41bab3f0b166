"""Eviction policies: activation-aware (Algorithm 2 with layer distance and recency), LRU, LFU,
neighbour-aware and the Belady oracle.

Every policy breaks ties by least recent use, then by key (see `EvictionPolicy`), so the victim
sequence of a replay is fully determined by its inputs.
"""

from __future__ import annotations

import numpy as np

from . import kernels
from .base import EvictionContext, EvictionPolicy, PolicyError


class ActivationAwareEviction(EvictionPolicy):
    """Evict the resident expert least worth its slot: the chance that its layer's next visit uses it,
    per layer visit it must be held until then,

        score[l][e] = (share[l][e] + eps) / (ahead(l) + 1),
        share[l][e] = (1 - f) * (recent[l][e] + a * seen[l][e] / sum(seen[l])) / (sum(recent[l]) + a)
                      + f * follow[l][e],

    where `ahead(l) = (l - c - 1) mod L` counts the layer visits before layer l comes round again after
    the current layer c (see `NeighborEviction`); `recent` is the running sequence's EAM with older
    tokens decayed (by `recency` per decision at which the layer grew); `seen` the accesses of the
    whole collection since `reset` (the collection prior, worth `a` = `prior_tokens` counts); and
    `follow` the share of layer l's experts that the collection's transitions predict for the token
    after the latest one: at each layer, the policy counts how often expert j served the token after
    one that expert i served (`transition`, learned online from the growth of `cur_eam` between
    decisions, one pair of consecutive foldings at a time), weighted by `f` = `follow`.

    Every token visits layers 0..L-1 in order, so a cache smaller than the working set sees a cyclic
    pattern on which recency alone (LRU) is the wrong signal: an expert of the layer just computed is
    needed last. Hit ratios on real routing (DeepSeek-V2-Lite, 26 x 64 experts, top-6, `moeinf bench
    cache --ablation`; docs/benchmarks.md), at 10% / 25% of experts cached (LRU 0.231 / 0.395, Belady
    0.447 / 0.675), the full score 0.267 / 0.474, and without each part:

    - the transitions (`follow=0`): 0.243 / 0.454. Which experts follow which, token to token, is the
      strongest signal there: the experts of the previous token alone predict the next token's top-6
      with recall 0.26, the transitions from them 0.28;
    - the distance term: 0.260 / 0.462;
    - the collection prior: 0.259 / 0.457;
    - recency (plain counts): 0.262 / 0.471; without the transitions too, recency is worth 2-3 points
      (an expert the previous token used serves the next one with chance 0.25, against 0.06 for one
      unused for 8 tokens).

    `recency=1, distance=False, follow=0` is Algorithm 2 of the paper, p = (share + eps) * (1 - l / L)
    (0.175 / 0.365 there with the fitted prior), its layer term scaled by how much prefetching covers,
    `ctx.prefetch_recall` r, as 1 - r * l / L (`layer_weighted=False` drops it: a cache with no
    prefetcher); the distance score has no layer term and ignores `ctx.prefetch_recall`.
    `prior_tokens=None` fits `a` online: every decision first scores the accesses since the previous
    one under each candidate in `PRIOR_TOKENS`, and the candidate with the highest log-likelihood so far
    is used.

    `ctx.cur_eam` is required.
    """

    name = "activation-aware"
    kind = kernels.ACTIVATION
    PRIOR_TOKENS = (0.5, 2.0, 8.0, 32.0, 128.0, 512.0, 2048.0)
    """Candidate prior strengths (tokens) of the online fit."""
    DEFAULT_PRIOR_TOKENS = 8.0
    DEFAULT_RECENCY = 0.7
    DEFAULT_FOLLOW = 0.85

    def __init__(self, num_layers: int, num_experts: int, *, eps: float = 1e-4,
                 prior_tokens: float | None = DEFAULT_PRIOR_TOKENS, layer_weighted: bool = True,
                 recency: float = DEFAULT_RECENCY, distance: bool = True,
                 follow: float = DEFAULT_FOLLOW) -> None:
        super().__init__(num_layers, num_experts)
        if not eps > 0:
            raise PolicyError(f"eps must be > 0 (OffloadConfig.eps), got {eps}")
        if prior_tokens is not None and prior_tokens < 0:
            raise PolicyError(f"prior_tokens must be >= 0 or None (fitted online), got {prior_tokens}")
        if not 0 <= follow <= 1:
            raise PolicyError(f"follow must lie in [0, 1] (0: no transition prediction), got {follow}")
        if not 0 <= recency <= 1:
            raise PolicyError(f"recency must lie in [0, 1] (1: the sequence's plain counts), got {recency}")
        self.eps = eps
        self.prior_tokens = prior_tokens
        self.layer_weighted = layer_weighted
        self.recency = recency
        self.distance = distance
        self.alphas = np.asarray(self.PRIOR_TOKENS, dtype=np.float64)  # [A]
        self.loglik = np.zeros(len(self.alphas))  # [A]
        self.params[kernels.P_EPS] = eps
        self.params[kernels.P_ALPHA] = prior_tokens or 0.0
        self.params[kernels.P_FIT] = prior_tokens is None
        self.params[kernels.P_LAYER_WEIGHTED] = layer_weighted
        self.params[kernels.P_RECALL] = 1.0
        self.params[kernels.P_DISTANCE] = distance
        self.params[kernels.P_RECENCY] = recency
        self.params[kernels.P_FOLLOW] = follow
        self.follow = follow
        if follow > 0:
            self.transition = np.zeros((num_layers * num_experts, num_experts + 1), dtype=np.float64)

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
        # float32 counts (the runtime's) are read as they are: the kernels compare and subtract them in
        # float64, exactly as after a conversion, which would copy all L*E of them at every decision
        dtype = eam.dtype if eam.dtype in (np.float32, np.float64) else np.float64
        return np.ascontiguousarray(eam, dtype=dtype).reshape(-1), self._no_future


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
