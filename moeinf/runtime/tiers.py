"""Memory tiers that hold expert blobs in fixed slots: the host tier (the engine's DRAM pool).

A tier is a set of `capacity` slots, each holding one expert. The caller (`ExpertCache`) decides what to
claim and what to evict; a tier only moves bytes: `submit` claims a slot and starts the transfer,
`poll`/`wait` report completion, `release` frees the slot. `tensors(key)` are the expert's runtime
tensors, zero-copy views of the slot (`Store.tensors` over the engine's buffer).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import torch

from ..engine import EngineError
from ..policy import Key


class Tier(ABC):
    """Fixed slots of expert blobs; claimed keys are in flight or resident, never more than `capacity`."""

    name: str
    capacity: int
    reads_from_disk: bool = True
    """True when a claim reads the store (the host tier); the device tier counts its own host reads."""

    @abstractmethod
    def submit(self, key: Key, priority: float) -> None:
        """Start bringing `key` in (or re-prioritise it if in flight); the caller made room first."""

    @abstractmethod
    def cancel(self, key: Key) -> bool:
        """Drop an in-flight transfer that has not started (or one that failed unseen); False if it can no
        longer be stopped."""

    @abstractmethod
    def is_resident(self, key: Key) -> bool: ...

    @abstractmethod
    def wait(self, key: Key) -> dict[str, torch.Tensor]:
        """Block until `key` is resident; its tensors (valid until `release`).

        If the transfer failed this raises (the engine's error names the expert and the file) and the key
        is no longer claimed: its slot is free and a later `submit` retries it."""

    @abstractmethod
    def release(self, key: Key) -> None:
        """Evict a resident key: its slot returns to the pool."""

    @abstractmethod
    def close(self) -> None:
        """Stop background work; the tier is unusable afterwards."""


class HostTier(Tier):
    """The engine's pool of aligned DRAM slots, filled from the store by the engine's I/O threads."""

    name = "host"

    def __init__(self, engine: object, store: object, capacity: int) -> None:
        self.engine = engine
        self.store = store
        self.capacity = capacity
        self._views: dict[Key, dict[str, torch.Tensor]] = {}

    def submit(self, key: Key, priority: float) -> None:
        self.engine.submit(key[0], key[1], priority)

    def cancel(self, key: Key) -> bool:
        return bool(self.engine.cancel(key[0], key[1]))

    def is_resident(self, key: Key) -> bool:
        return bool(self.engine.is_resident(key[0], key[1]))

    def wait(self, key: Key) -> dict[str, torch.Tensor]:
        views = self._views.get(key)
        if views is None:
            try:
                buffer = self.engine.wait(key[0], key[1])
            except EngineError:
                self.engine.cancel(key[0], key[1])  # the failed read: idle again, retried by the next submit
                raise
            views = self.store.tensors(key[0], key[1], buffer)
            self._views[key] = views
        return views

    def release(self, key: Key) -> None:
        self._views.pop(key, None)
        self.engine.release(key[0], key[1])

    def close(self) -> None:
        self._views.clear()
        self.engine.close()


def timed_wait(tier: Tier, key: Key) -> tuple[dict[str, torch.Tensor], float]:
    """`tier.wait(key)` and the seconds it blocked."""
    start = time.perf_counter()
    tensors = tier.wait(key)
    return tensors, time.perf_counter() - start
