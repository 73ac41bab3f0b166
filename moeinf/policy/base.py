"""The contracts of every policy: keys, the eviction context and the two abstract bases.

Policies are pure deciders: they receive keys `(layer, expert)` and numpy arrays and return keys and
priorities. They never touch a file, a tensor or a thread, so the runtime, the offline simulator
(`moeinf.policy.simulate`) and the tests drive the very same objects.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from . import kernels

Key = tuple[int, int]
"""(MoE-layer ordinal 0..L-1, expert index 0..E-1)."""


class PolicyError(ValueError):
    """A policy was asked something it cannot answer; the message says what to change."""


@dataclass(frozen=True)
class EvictionContext:
    """What an eviction policy may look at when it must pick a victim.

    `cur_eam` is the [L, E] token-count matrix of the running sequence(s) (Algorithm 2 reads it),
    `layer` the MoE layer being computed, `protected` the keys the current layer needs (never
    evicted). `next_use` (the position of each key's next access, flat [L * E] int64, `kernels.NEVER`
    for none) and `future` (the remaining accesses, in order: the simple form) exist for the Belady
    oracle and only a simulator can fill them.
    """

    cur_eam: np.ndarray | None
    layer: int
    protected: frozenset[Key] = frozenset()
    future: Sequence[Key] = ()
    next_use: np.ndarray | None = None
    prefetch_recall: float = 1.0
    """Share of the accesses that prefetches served so far: how far prefetching covers the layers ahead.
    Activation-aware eviction scales its (1 - l / L) term by it (1.0: the paper's formula)."""


class EvictionPolicy:
    """Chooses which resident expert leaves a full tier.

    The owner of the tier reports events (`on_access` when compute used an expert, a hit or a
    completed miss; `on_insert` when an expert became resident; `on_evict` when it left); the policy
    therefore knows the resident set, and `victims(ctx, count, exclude)` picks among it, never a key
    of `ctx.protected` or `exclude`. Ties are always broken the same way: least recently used first
    (recency = the later of last access and insertion), then the smaller key, so a replay is
    deterministic.

    State lives in flat [L * E] numpy arrays indexed by `layer * E + expert` (recency stamps, access
    counts, residency), and the choice is one compiled pass over them (`kernels.select`), shared by the
    runtime and the simulator's replay loop (`kernels.replay`). Subclasses set `kind` and may fill
    `params`.
    """

    name: str = ""
    kind: int = -1
    needs_future: bool = False
    """True for the oracle: the caller must fill `ctx.future` or `ctx.next_use`."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        if num_layers < 1 or num_experts < 1:
            raise PolicyError(f"num_layers and num_experts must be >= 1, got {num_layers}, {num_experts}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        size = num_layers * num_experts
        self.stamp = np.full(size, -1, dtype=np.int64)  # [L*E] recency clock of the last touch
        self.count = np.zeros(size, dtype=np.float64)  # [L*E] accesses since reset
        self.resident = np.zeros(size, dtype=np.bool_)  # [L*E]
        self.clock = np.zeros(1, dtype=np.int64)  # an array, so that the compiled replay advances it
        self.params = np.zeros(kernels.NUM_PARAMS, dtype=np.float64)
        # activation-aware eviction's view of the running sequence and its online prior fit (unused by
        # the other kinds; see kernels.observe)
        self.alphas = np.zeros(1, dtype=np.float64)  # [A]
        self.loglik = np.zeros(1, dtype=np.float64)  # [A]
        self.running = np.zeros((5, size), dtype=np.float64)  # kernels.LAST, RECENT, PREVIOUS, FOLLOW, SLOW
        self.layer_state = np.zeros((3, num_layers), dtype=np.float64)  # kernels.TOTAL, FOLLOWED, SLOW_TOTAL
        self.transition = np.zeros((1, 1), dtype=np.float64)  # [L*E, E+1] where learned (activation-aware)
        self.flags = np.zeros(1, dtype=np.int64)  # flags[0] = 1 once `last` holds a snapshot
        self._blocked = np.zeros(size, dtype=np.bool_)
        self._last_marked: tuple[frozenset[Key], Collection[Key], np.ndarray] | None = None
        # the resident keys as a list (members[:occupancy], slot[key] = its position) and the access counts
        # per layer, kept as events arrive so that a decision need not scan all L*E keys for them; None
        # until first needed after a reset (the compiled replay moves `resident` and `count` itself)
        self._members: np.ndarray | None = None
        self._slot = np.full(size, -1, dtype=np.int64)
        self._occupancy = 0
        self._seen_total: np.ndarray | None = None
        self._no_eam = np.zeros(size, dtype=np.float64)
        self._no_future = np.full(size, kernels.NEVER, dtype=np.int64)

    def index(self, key: Key) -> int:
        """The flat index `layer * E + expert` of `key`."""
        layer, expert = key
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise PolicyError(f"key {key} is outside the {self.num_layers} x {self.num_experts} experts")
        return layer * self.num_experts + expert

    def indices(self, keys: Sequence[Key]) -> np.ndarray:
        """The flat indices of `keys`, as `index` gives them (one array operation for many keys)."""
        pairs = np.array(keys, dtype=np.int64).reshape(-1, 2)  # [n, (layer, expert)]
        outside = (pairs < 0).any(axis=1) | (pairs >= (self.num_layers, self.num_experts)).any(axis=1)
        if outside.any():
            self.index(tuple(int(v) for v in pairs[int(np.argmax(outside))]))  # raises, naming the key
        return pairs[:, 0] * self.num_experts + pairs[:, 1]

    def key(self, index: int) -> Key:
        """The key `(layer, expert)` of flat index `index`."""
        layer, expert = divmod(int(index), self.num_experts)
        return layer, expert

    def on_access(self, key: Key) -> None:
        index = self.index(key)
        self._touch(index)
        self.count[index] += 1.0
        if self._seen_total is not None:
            self._seen_total[key[0]] += 1.0

    def on_insert(self, key: Key) -> None:
        index = self.index(key)
        if not self.resident[index] and self._members is not None:
            self._members[self._occupancy] = index
            self._slot[index] = self._occupancy
            self._occupancy += 1
        self.resident[index] = True
        self._touch(index)

    def on_evict(self, key: Key) -> None:
        index = self.index(key)
        if self.resident[index] and self._members is not None:
            self._occupancy -= 1
            moved = self._members[self._occupancy]  # swap-remove: the last member takes the slot
            self._members[self._slot[index]] = moved
            self._slot[moved] = self._slot[index]
            self._slot[index] = -1
        self.resident[index] = False

    def _resident_members(self) -> np.ndarray:
        """The resident keys (flat indices, in no particular order)."""
        if self._members is None:
            members = np.flatnonzero(self.resident)
            self._occupancy = members.size
            self._members = np.zeros(self.resident.size, dtype=np.int64)
            self._members[: self._occupancy] = members
            self._slot.fill(-1)
            self._slot[members] = np.arange(self._occupancy)
        return self._members[: self._occupancy]

    def _layer_counts(self) -> np.ndarray:
        """[L] the access counts summed per layer."""
        if self._seen_total is None:
            self._seen_total = self.count.reshape(self.num_layers, self.num_experts).sum(axis=1)
        return self._seen_total

    def reset(self, counts: np.ndarray | None = None, firsts: np.ndarray | None = None) -> None:
        """Forget every event (a fresh, empty cache). `counts` ([L, E] whole numbers of accesses, e.g. the
        activation counts of the sequences an EAMC was built from) starts the access counts from a known
        collection instead of zero: LFU's frequencies and activation-aware eviction's prior. `firsts` ([L,
        E], how many of those sequences used each expert) adds `kernels.P_FIRST` x that, as the policy
        would have counted their first uses."""
        self.stamp.fill(-1)
        self.count.fill(0.0)
        if counts is not None:
            self.count += self._seed("counts", counts)
        if firsts is not None:
            self.count += self.params[kernels.P_FIRST] * self._seed("firsts", firsts)
        self.resident.fill(False)
        self._members = None
        self._seen_total = None
        self.clock[0] = 0
        self.loglik.fill(0.0)
        self.running.fill(0.0)
        self.layer_state.fill(0.0)
        self.transition.fill(0.0)
        self.flags[0] = 0

    def _seed(self, name: str, seed: np.ndarray) -> np.ndarray:
        """`seed` as flat float64 counts; a `PolicyError` naming `name` unless it is [L, E] whole numbers
        >= 0."""
        seed = np.asarray(seed, dtype=np.float64)
        if seed.shape != (self.num_layers, self.num_experts) or (seed < 0).any() or (seed % 1).any():
            raise PolicyError(f"{name} must be [{self.num_layers}, {self.num_experts}] whole numbers >= 0, "
                              f"got shape {seed.shape}")
        return seed.reshape(-1)

    def victim(self, ctx: EvictionContext, exclude: Collection[Key] = ()) -> Key:
        """The resident key to evict; `PolicyError` when every resident key is protected or excluded."""
        chosen = self.victims(ctx, 1, exclude)
        if not chosen:
            raise PolicyError(
                f"cannot evict: all {int(self.resident.sum())} resident experts are needed by layer "
                f"{ctx.layer}; the cache must hold at least the experts of one layer (raise device_cache / "
                "the capacity)"
            )
        return chosen[0]

    def victims(self, ctx: EvictionContext, count: int, exclude: Collection[Key] = ()) -> list[Key]:
        """Up to `count` resident keys to evict, in eviction order (fewer only when fewer may go)."""
        blocked = self._blocked
        marked = self._marked(ctx.protected, exclude)
        blocked[marked] = True
        try:
            eam, next_use = self._context_arrays(ctx)
            out = np.empty(count, dtype=np.int64)
            found = kernels.select(self.kind, self.params, self.num_layers, self._resident_members(),
                                   self.stamp, self.count, blocked, eam, ctx.layer, next_use, self.alphas,
                                   self.loglik, self.running, self.layer_state, self.transition, self.flags,
                                   self._layer_counts(), out)
        finally:
            blocked[marked] = False
        return [self.key(index) for index in out[:found]]

    def _marked(self, protected: frozenset[Key], exclude: Collection[Key]) -> np.ndarray:
        """Flat indices of `protected` and `exclude`. A cache filling up asks for victims once per read
        with the same two sets, so the indices of the last immutable pair are kept."""
        last = self._last_marked
        if last is not None and last[0] is protected and last[1] is exclude:
            return last[2]
        marked = self.indices((*protected, *exclude))
        if isinstance(exclude, (frozenset, tuple)):
            self._last_marked = (protected, exclude, marked)
        return marked

    def _context_arrays(self, ctx: EvictionContext) -> tuple[np.ndarray, np.ndarray]:
        """(cur_eam, next_use) as the flat [L*E] arrays `kernels.select` reads (zeros / never if absent)."""
        return self._no_eam, self._no_future

    def _touch(self, index: int) -> None:
        self.stamp[index] = self.clock[0]
        self.clock[0] += 1


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
