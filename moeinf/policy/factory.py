"""Build an eviction policy from its `OffloadConfig.eviction` name (the fixed policies of `eviction.py` and
the fitted one of `fitted.py`)."""

from __future__ import annotations

from typing import Any

from .base import EvictionPolicy, PolicyError
from .eviction import ActivationAwareEviction, LFUEviction, LRUEviction, NeighborEviction, OracleEviction
from .fitted import FittedEviction


def make_eviction(name: str, num_layers: int, num_experts: int, eps: float = 1e-4, *,
                  allow_oracle: bool = False, prefetching: bool = True, fit: Any = None,
                  top_k: float = 1.0) -> EvictionPolicy:
    """Build an eviction policy from its `OffloadConfig.eviction` name (`oracle` needs `allow_oracle`,
    which only a simulator should pass). `prefetching=False` says the cache has no prefetcher (see
    `ActivationAwareEviction.layer_weighted`). `fitted` takes `fit` (an `EvictionFit`, e.g. the one
    `moeinf trace` saved beside the EAMC); without one it refits itself online from what it serves."""
    if name == "fitted":
        return FittedEviction(num_layers, num_experts, fit, eps=eps, top_k=top_k, online=fit is None)
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
                      "fitted, activation-aware, lru, lfu, neighbor (or oracle in the simulator)")
