"""Residency of experts in the compute tier: demand fetches, prefetches and eviction by policy.

`ExpertCache` owns the bookkeeping of one tier: which keys are resident, which are in flight, which were
brought by a prefetch and not used yet. It asks the eviction policy for a victim whenever a claim needs a
slot, never evicts what the current layer still needs, and serves a layer's experts in the order they
become resident (`acquire`).

Prefetching follows the rules the simulator (`moeinf.policy.simulate`) measured: at most `window`
prefetched experts wait unused for a layer still ahead in the forward pass (a quarter of the tier by
default), and a prefetch never evicts such an expert. Without them an uncertain plan cycles the tier:
each refresh evicts the previous refresh's prefetches (they have no count in the sequence's EAM yet, so
Algorithm 2 ranks them lowest) and the sequence's own experts, and most bytes read are never used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

import torch

from ..policy import EvictionContext, EvictionPolicy, Key
from .stats import RuntimeStats
from .tiers import Tier, timed_wait

log = logging.getLogger(__name__)


class ExpertCache:
    """Claims on the slots of `tier`, decided by `eviction`; counts into `stats`.

    `blob_size(key)` gives the bytes a read of `key` moves (for `bytes_read`); `max_priority` is the
    engine's MAX_PRIORITY, used for demand fetches so they jump every queued prefetch.
    """

    def __init__(self, tier: Tier, eviction: EvictionPolicy, stats: RuntimeStats,
                 blob_size: Callable[[Key], int], max_priority: float, *, window: int | None = None) -> None:
        self.tier = tier
        self.window = max(1, tier.capacity // 4) if window is None else window
        """Most prefetched experts that may wait unused for a layer ahead of the computation."""
        self.eviction = eviction
        set_capacity = getattr(eviction, "set_capacity", None)
        if set_capacity is not None:  # a fitted policy takes the constants fitted for this cache's size
            set_capacity(tier.capacity)
        self.stats = stats
        self.blob_size = blob_size
        self.max_priority = max_priority
        self.resident: dict[Key, None] = {}
        self.in_flight: dict[Key, float] = {}
        self.prefetched: set[Key] = set()
        """Keys a prefetch claimed in this forward pass that no access has used yet."""

    # --- bookkeeping -------------------------------------------------------------------------------
    def _landed(self, key: Key) -> None:
        del self.in_flight[key]
        self.resident[key] = None
        self.eviction.on_insert(key)
        if self.tier.reads_from_disk:
            self.stats.reads += 1
            self.stats.bytes_read += self.blob_size(key)
        else:
            self.stats.device_copies += 1

    def refresh(self, keys: Sequence[Key] | None = None) -> None:
        """Move the in-flight keys (of `keys`, default all) that the tier now holds to `resident`.

        Each check is a call into the tier: a batch keeps tens of reads in flight, so the hot paths check
        only the keys they wait for (`acquire`) or scan only when they must (`_make_room`)."""
        candidates = self.in_flight if keys is None else [k for k in keys if k in self.in_flight]
        for key in [k for k in candidates if self.tier.is_resident(k)]:
            self._landed(key)

    def _evict(self, key: Key) -> None:
        self.tier.release(key)
        del self.resident[key]
        self.eviction.on_evict(key)
        if key in self.prefetched:
            self.prefetched.discard(key)
            self.stats.unused_evictions += 1
        self.stats.evictions += 1

    def _make_room(self, ctx: EvictionContext, keep: frozenset[Key]) -> bool:
        """Free one slot if the tier is full; False when every resident key must stay."""
        if len(self.resident) + len(self.in_flight) < self.tier.capacity:
            return True
        # the policy knows the resident keys (on_insert / on_evict): no O(resident) list here; reads that
        # landed since the last scan become candidates only when no resident key can go
        victims = self.eviction.victims(ctx, 1, exclude=keep)
        if not victims:
            self.refresh()
            victims = self.eviction.victims(ctx, 1, exclude=keep)
        if not victims:
            return False
        self._evict(victims[0])
        return True

    def _claim(self, key: Key, priority: float) -> None:
        self.tier.submit(key, priority)
        self.in_flight[key] = priority

    # --- prefetch ----------------------------------------------------------------------------------
    def claim_rest(self, keys: Sequence[Key], priority: float) -> None:
        """Claim the `keys` neither resident nor in flight, while the tier has room (the whole model in
        a cache that holds it)."""
        for key in keys:
            if len(self.resident) + len(self.in_flight) >= self.tier.capacity:
                return
            if key not in self.resident and key not in self.in_flight:
                self._claim(key, priority)

    def new_pass(self) -> None:
        """A forward pass starts: last pass's unused resident prefetches become plain cache content."""
        self.prefetched.intersection_update(self.in_flight)

    def prefetch(self, plan: Sequence[tuple[Key, float]], ctx: EvictionContext,
                 max_new: int | None = None) -> list[Key]:
        """Bring in the best-ranked planned keys that fit, re-prioritise those in flight, cancel dropped ones;
        returns the keys wanted (the head of `plan` the tier has room for), claimed or not.

        Only the top `capacity - |protected|` entries are wanted: fetching more would evict what the
        plan itself ranks higher. Victims are never protected, wanted, nor an unused prefetch of a layer
        ahead. `max_new` caps the reads one refresh may start (about what one layer consumes), and the
        window caps the unused prefetches of layers ahead, so an uncertain plan cannot cycle the tier.
        """
        room = max(self.tier.capacity - len(ctx.protected), 0)
        wanted = dict(list(plan)[:room])
        for key in [k for k in self.in_flight if k not in wanted and k not in ctx.protected]:
            if self.in_flight[key] < self.max_priority and self.tier.cancel(key):
                del self.in_flight[key]
                if key in self.prefetched:
                    self.prefetched.discard(key)
                    self.stats.cancelled_prefetches += 1
        ahead = frozenset(k for k in self.prefetched if k[0] > ctx.layer)
        keep = frozenset(wanted) | ahead
        window = self.window - len(ahead)
        max_new = window if max_new is None else min(max_new, window)
        for key, priority in wanted.items():
            if key in self.resident:
                continue
            if key in self.in_flight:
                if self.in_flight[key] != priority and self.in_flight[key] < self.max_priority:
                    self.tier.submit(key, priority)
                    self.in_flight[key] = priority
                continue
            if max_new <= 0:
                break
            if not self._make_room(ctx, keep):
                break
            max_new -= 1
            self._claim(key, priority)
            self.prefetched.add(key)
            self.stats.prefetches += 1
        stage = getattr(self.tier, "stage", None)
        if stage is not None:
            # Two tiers: what the device tier cannot hold is staged in the host tier, next in the plan.
            for key, priority in list(plan)[room:]:
                if key not in self.resident and key not in self.in_flight and not stage(key, priority):
                    break
        return list(wanted)

    def holds(self, keys: Sequence[Key]) -> bool:
        """Every key of `keys` is resident or in flight (reads that landed are not moved to `resident`)."""
        return all(key in self.resident or key in self.in_flight for key in keys)

    # --- demand ------------------------------------------------------------------------------------
    def acquire(self, keys: Sequence[Key], ctx_for: Callable[[frozenset[Key]], EvictionContext]
                ) -> Iterator[tuple[Key, dict[str, torch.Tensor]]]:
        """Yield `(key, tensors)` for every key, resident ones first, then misses as they land.

        Misses are demand-fetched at MAX priority; keys still pending are protected from eviction, so a
        budget of at least one slot always makes progress (a layer needing more experts than the tier
        holds is served in waves). `ctx_for(protected)` builds the eviction context.
        """
        for wave in self.acquire_waves(keys, ctx_for):
            yield from wave

    def take_resident(self, keys: Sequence[Key]) -> list[dict[str, torch.Tensor]] | None:
        """The tensors of distinct `keys` if every one is resident, each access counted (a hit) and seen by
        the eviction policy as `demand` and `acquire_waves` would; None, counting nothing, otherwise."""
        resident = self.resident
        if not all(key in resident for key in keys):
            return None
        tensors = []
        for key in keys:
            self._count_access(key)
            self.eviction.on_access(key)
            tensors.append(self.tier.wait(key))
        return tensors

    def demand(self, keys: Sequence[Key], ctx: EvictionContext) -> set[Key]:
        """Count the accesses of `keys` and claim their misses at MAX priority now, before any prefetch
        of this layer is submitted, so that the I/O threads take the demand reads' chunks next.

        Returns the keys claimed or raised to demand priority; pass it to `acquire_waves(keys, ...,
        demanded=...)`, which then serves the keys without counting them again. A miss that finds no
        slot now is claimed by `acquire_waves` once one frees up."""
        pending = list(dict.fromkeys(keys))
        self.refresh(pending)
        for key in pending:
            self._count_access(key)
        claimed: set[Key] = set()
        self._claim_misses(pending, ctx, frozenset(pending), claimed)
        return claimed

    def _claim_misses(self, keys: list[Key], ctx: EvictionContext, keep: frozenset[Key],
                      claimed: set[Key]) -> None:
        """Raise the in-flight `keys` to MAX priority and claim the missing ones that find a slot (evicting
        nothing in `keep`); `claimed` collects the keys claimed or raised."""
        for key in keys:
            if key in self.resident:
                continue
            if key in self.in_flight:
                if self.in_flight[key] < self.max_priority:
                    self.tier.submit(key, self.max_priority)
                    self.in_flight[key] = self.max_priority
                    claimed.add(key)
            elif self._make_room(ctx, keep):
                self._claim(key, self.max_priority)
                claimed.add(key)

    def acquire_waves(self, keys: Sequence[Key], ctx_for: Callable[[frozenset[Key]], EvictionContext],
                      demanded: set[Key] | None = None, idle: Callable[[], None] | None = None
                      ) -> Iterator[list[tuple[Key, dict[str, torch.Tensor]]]]:
        """`acquire` in waves: every key resident when the wave is formed, then each miss as it lands (or
        the misses that landed together), so a caller can compute a wave's experts in one go.

        `demanded` is what `demand(keys, ...)` returned when the caller claimed the misses first (the
        accesses are counted there); None counts and claims here. `idle` runs once, the first time no
        pending key is resident, before this blocks (the layer's other work fills the wait)."""
        self.refresh()
        pending = list(dict.fromkeys(keys))
        if demanded is None:
            for key in pending:
                self._count_access(key)
        # the keys this request claimed or raised to demand priority
        claimed: set[Key] = set() if demanded is None else set(demanded)
        while pending:
            ready = [k for k in pending if k in self.resident]
            if not ready and idle is not None:
                idle()
                idle = None
                self.refresh(pending)
                ready = [k for k in pending if k in self.resident]
            if not ready:
                ready = [self._fetch_one(pending, ctx_for(frozenset(pending)), claimed)]
            wave = []
            for key in ready:
                pending.remove(key)
                self.eviction.on_access(key)
                wave.append((key, self.tier.wait(key)))
            yield wave
            self.refresh(pending)

    def _count_access(self, key: Key) -> None:
        self.stats.accesses += 1
        if key in self.prefetched:
            self.stats.useful_prefetches += 1
            self.prefetched.discard(key)
            if key not in self.resident:
                self.stats.late_prefetches += 1
        if key in self.resident:
            self.stats.hits["device"] += 1
            return
        self.stats.misses["device"] += 1
        in_host = getattr(self.tier, "in_host", None)
        if in_host is not None:
            if in_host(key):
                self.stats.hits["host"] += 1
            else:
                self.stats.misses["host"] += 1
        if key not in self.in_flight:
            self.stats.demand_reads += 1
            by_layer = self.stats.demand_reads_by_layer
            by_layer[key[0]] = by_layer.get(key[0], 0) + 1

    def _fetch_one(self, pending: list[Key], ctx: EvictionContext, claimed: set[Key]) -> Key:
        """Claim every pending miss that fits, then block until the first claimed one lands. `claimed`
        collects the keys this demand claimed or promoted (see `_wait_landed`)."""
        self._claim_misses(pending, ctx, frozenset(), claimed)
        self.refresh(pending)
        landed = [k for k in pending if k in self.resident]
        if landed:
            return landed[0]
        waiting = [k for k in pending if k in self.in_flight]
        if not waiting:
            # Every slot is in flight for keys this layer does not need: let one land, then evict it.
            other = next(iter(self.in_flight))
            try:
                self._wait_landed(other)
            except Exception as exc:  # a prefetch nobody needs now failed: its slot is free again
                log.warning("prefetch of expert %s failed: %s", other, exc)
            return self._fetch_one(pending, ctx, claimed)
        key = waiting[0]
        try:
            self._wait_landed(key)
        except Exception as exc:
            if key in claimed:
                raise
            # A demand claim left by an earlier request that failed (its error is that request's, and
            # may predate a repair): read it again once for this one.
            log.warning("expert %s: a read claimed by an earlier request failed (%s); reading it again", key,
                        exc)
            return self._fetch_one(pending, ctx, claimed)
        return key

    def _wait_landed(self, key: Key) -> None:
        """Block until the in-flight `key` is resident. If its read failed, the tier has let go of the
        key (`Tier.wait`): forget the claim too, so the error reaches the caller and the next access
        reads it again instead of waiting on a dead claim forever."""
        try:
            _, stalled = timed_wait(self.tier, key)
        except Exception:
            del self.in_flight[key]
            self.prefetched.discard(key)
            raise
        self.stats.stall_s += stalled
        self._landed(key)

    def clear(self) -> None:
        """Release every slot (after an error or on close)."""
        for key in list(self.in_flight):
            if self.tier.cancel(key):
                continue
            try:
                self.tier.wait(key)
            except Exception as exc:  # a failed read holds no slot (Tier.wait): nothing to release
                log.debug("clear: the read of %s had failed: %s", key, exc)
                continue
            self.tier.release(key)
        self.in_flight.clear()
        for key in list(self.resident):
            self.tier.release(key)
            self.eviction.on_evict(key)
        self.resident.clear()
        self.prefetched.clear()
