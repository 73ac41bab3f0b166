"""The contracts of every policy: keys, the eviction context and the two abstract bases.

Policies are pure deciders: they receive keys `(layer, expert)` and numpy arrays and return keys and
priorities. They never touch a file, a tensor or a thread, so the runtime, the offline simulator
(`moeinf.policy.simulate`) and the tests drive the very same objects.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Key = tuple[int, int]
"""(MoE-layer ordinal 0..L-1, expert index 0..E-1)."""


class PolicyError(ValueError):
    """A policy was asked something it cannot answer; the message says what to change."""


@dataclass(frozen=True)
class EvictionContext:
    """What an eviction policy may look at when it must pick a victim.

    `cur_eam` is the [L, E] token-count matrix of the running sequence(s) (Algorithm 2 reads it),
    `layer` the MoE layer being computed, `protected` the keys the current layer needs (never
    evicted). `future` (the remaining accesses, in order) and `next_use` (key -> position of its next
    access; absent = never used again) exist for the Belady oracle and only a simulator can fill them;
    `next_use` is the fast form, `future` the simple one.
    """

    cur_eam: np.ndarray | None
    layer: int
    protected: frozenset[Key] = frozenset()
    future: Sequence[Key] = ()
    next_use: Mapping[Key, int] | None = None
    prefetch_recall: float = 1.0
    """Share of the accesses that prefetches served so far: how far prefetching covers the layers ahead.
    Activation-aware eviction scales its (1 - l / L) term by it (1.0: the paper's formula)."""


class EvictionPolicy(ABC):
    """Chooses which resident expert leaves a full tier.

    The owner of the tier reports events (`on_access` when compute used an expert, a hit or a
    completed miss; `on_insert` when an expert became resident; `on_evict` when it left) and asks
    `victim(resident, ctx)` before inserting into a full tier. `victim` never returns a protected key
    and raises `PolicyError` when every resident key is protected. Ties are always broken the same
    way: least recently used first (recency = the later of last access and insertion), then the
    smaller key, so a replay is deterministic.
    """

    name: str = ""
    needs_future: bool = False
    """True for the oracle: the caller must fill `ctx.future` or `ctx.next_use`."""

    def __init__(self) -> None:
        self._clock = 0
        self._last_use: dict[Key, int] = {}

    def on_access(self, key: Key) -> None:
        self._touch(key)

    def on_insert(self, key: Key) -> None:
        self._touch(key)

    def on_evict(self, key: Key) -> None:
        self._last_use.pop(key, None)

    def reset(self) -> None:
        """Forget every event (a fresh cache)."""
        self._clock = 0
        self._last_use.clear()

    @abstractmethod
    def victim(self, resident: Sequence[Key], ctx: EvictionContext) -> Key:
        """The resident, unprotected key to evict."""

    def victims(self, resident: Sequence[Key], ctx: EvictionContext, count: int) -> list[Key]:
        """`count` keys to evict, in eviction order (repeated `victim` on the shrinking set)."""
        left = list(resident)
        chosen: list[Key] = []
        for _ in range(count):
            key = self.victim(left, ctx)
            chosen.append(key)
            left.remove(key)
        return chosen

    def _touch(self, key: Key) -> None:
        self._clock += 1
        self._last_use[key] = self._clock

    def _candidates(self, resident: Sequence[Key], ctx: EvictionContext) -> list[Key]:
        candidates = [key for key in resident if key not in ctx.protected]
        if not candidates:
            raise PolicyError(
                f"cannot evict: all {len(resident)} resident experts are needed by layer {ctx.layer}; "
                "the cache must hold at least the experts of one layer (raise device_cache / the capacity)"
            )
        return candidates

    def _lowest(self, candidates: Sequence[Key], scores: Sequence[float] | np.ndarray) -> Key:
        """The candidate with the lowest score; ties by least recent use, then by key."""
        values = np.asarray(scores, dtype=np.float64)  # [C]
        recency = np.fromiter((self._last_use.get(key, -1) for key in candidates), dtype=np.int64,
                              count=len(candidates))  # [C]
        keys = np.asarray(candidates, dtype=np.int64).reshape(-1, 2)  # [C, 2]
        # lexsort: the last key is the primary one
        best = np.lexsort((keys[:, 1], keys[:, 0], recency, values))[0]
        return candidates[int(best)]


class PrefetchPolicy(ABC):
    """Decides, after the router of a layer, which experts of later layers to fetch and how urgently.

    `plan(layer, cur_eam, matched)` returns `[(key, priority), ...]`, highest priority first, for
    experts of layers > `layer` only (within `lookahead` layers; 0 = all later layers). Priorities lie
    in (0, 1 + eps]; demand fetches use the engine's MAX_PRIORITY, above all of them. The plan is the
    full set wanted now: the caller re-submits its keys with the new priorities and may drop queued
    prefetches the plan no longer lists. `matched` is the predicted EAM [L, E] (from the EAMC), or None
    when no prediction exists; `cur_eam` is the running sequence's counts, including `layer`.

    With `refine=False` a plan is made once per forward pass: `should_plan(layer)` is True only for
    the first MoE layer, and callers skip `plan` otherwise (the queued plan stays as it is).
    """

    name: str = ""

    def __init__(self, num_layers: int, num_experts: int, *, eps: float = 1e-4, lookahead: int = 0,
                 refine: bool = True) -> None:
        if num_layers < 1 or num_experts < 1:
            raise PolicyError(f"num_layers and num_experts must be >= 1, got {num_layers}, {num_experts}")
        if not eps > 0:
            raise PolicyError(f"eps must be > 0 (OffloadConfig.eps), got {eps}")
        if lookahead < 0:
            raise PolicyError(f"lookahead must be >= 0 (OffloadConfig.prefetch_layers), got {lookahead}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.eps = eps
        self.lookahead = lookahead
        self.refine = refine

    def should_plan(self, layer: int) -> bool:
        """Whether the caller should ask for a new plan after the router of `layer`."""
        return self.refine or layer == 0

    @abstractmethod
    def plan(self, layer: int, cur_eam: np.ndarray, matched: np.ndarray | None) -> list[tuple[Key, float]]:
        """Experts of later layers to fetch, with priorities, highest first."""

    def _later_layers(self, layer: int) -> range:
        last = self.num_layers if self.lookahead == 0 else min(self.num_layers, layer + 1 + self.lookahead)
        return range(layer + 1, last)

    def _check(self, name: str, eam: np.ndarray) -> np.ndarray:
        array = np.asarray(eam, dtype=np.float64)
        if array.shape != (self.num_layers, self.num_experts):
            raise PolicyError(
                f"{self.name}: {name} has shape {array.shape}, expected "
                f"({self.num_layers}, {self.num_experts}) = (MoE layers, experts)"
            )
        return array


def layer_priorities(eam: np.ndarray, eps: float) -> np.ndarray:
    """p[l][e] = (eam[l][e] / sum(eam[l]) + eps) * (1 - l / L), the score of Algorithms 1 and 2.

    A row with no tokens has share 0 everywhere, so its experts keep only the eps, layer-ordered part.
    """
    counts = np.asarray(eam, dtype=np.float64)  # [L, E]
    num_layers = counts.shape[0]
    totals = counts.sum(axis=1, keepdims=True)  # [L, 1]
    shares = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    depth = 1.0 - np.arange(num_layers, dtype=np.float64) / num_layers  # [L]
    return (shares + eps) * depth[:, None]


def ranked(entries: list[tuple[Key, float]]) -> list[tuple[Key, float]]:
    """Highest priority first; equal priorities by key, so plans are deterministic."""
    return sorted(entries, key=lambda item: (-item[1], item[0]))
