"""Eviction policies: activation-aware (Algorithm 2), LRU, LFU, neighbour-aware and the Belady oracle.

Every policy breaks ties by least recent use, then by key (see `EvictionPolicy`), so the victim
sequence of a replay is fully determined by its inputs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from .base import EvictionContext, EvictionPolicy, Key, PolicyError, layer_priorities


class ActivationAwareEviction(EvictionPolicy):
    """Algorithm 2: evict the resident expert with the lowest p = (cur_eam[l][e] / sum(cur_eam[l]) + eps)
    * (1 - l / L).

    The share term keeps the experts the running sequence keeps reusing; the (1 - l / L) term keeps
    experts of early layers, which prefetching cannot bring in time. `ctx.cur_eam` is required.
    """

    name = "activation-aware"

    def __init__(self, num_layers: int, num_experts: int, *, eps: float = 1e-4) -> None:
        super().__init__()
        if not eps > 0:
            raise PolicyError(f"eps must be > 0 (OffloadConfig.eps), got {eps}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.eps = eps

    def victim(self, resident: Sequence[Key], ctx: EvictionContext) -> Key:
        candidates = self._candidates(resident, ctx)
        if ctx.cur_eam is None:
            raise PolicyError("activation-aware eviction needs ctx.cur_eam, the running sequence's "
                              "[L, E] token counts")
        eam = np.asarray(ctx.cur_eam)
        if eam.shape != (self.num_layers, self.num_experts):
            raise PolicyError(
                f"activation-aware eviction: cur_eam has shape {eam.shape}, expected "
                f"({self.num_layers}, {self.num_experts})"
            )
        scores = layer_priorities(eam, self.eps)  # [L, E]
        index = np.array(candidates, dtype=np.int64)  # [C, 2]
        return self._lowest(candidates, scores[index[:, 0], index[:, 1]].tolist())


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
                  allow_oracle: bool = False) -> EvictionPolicy:
    """Build an eviction policy from its `OffloadConfig.eviction` name (`oracle` needs `allow_oracle`,
    which only a simulator should pass)."""
    if name == "activation-aware":
        return ActivationAwareEviction(num_layers, num_experts, eps=eps)
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
