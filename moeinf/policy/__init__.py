"""Pure policy objects (numpy only, no I/O, no torch): which experts to prefetch and which to evict.

The runtime and the offline simulator (`moeinf.policy.simulate`) drive the same objects.
"""

from __future__ import annotations

from .base import EvictionContext, EvictionPolicy, Key, PolicyError, PrefetchPolicy, layer_priorities
from .eviction import (
    ActivationAwareEviction,
    LFUEviction,
    LRUEviction,
    NeighborEviction,
    OracleEviction,
)
from .factory import make_eviction
from .prefetch import (
    ActivationAwarePrefetch,
    NoPrefetch,
    TopKPrefetch,
    TracedTopKPrefetch,
    make_prefetch,
    popularity,
)

__all__ = [
    "ActivationAwareEviction",
    "ActivationAwarePrefetch",
    "EvictionContext",
    "EvictionPolicy",
    "Key",
    "LFUEviction",
    "LRUEviction",
    "NeighborEviction",
    "NoPrefetch",
    "OracleEviction",
    "PolicyError",
    "PrefetchPolicy",
    "TopKPrefetch",
    "TracedTopKPrefetch",
    "layer_priorities",
    "make_eviction",
    "make_prefetch",
    "popularity",
]
