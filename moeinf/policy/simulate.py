"""Offline replay of routing traces through the real policy objects: hit ratio, prefetch recall/precision.

Input: one int array [S, L, E] per sequence, the tokens routed to each expert at each forward step
(step 0 = the prefill, then one step per generated token), the format of `moeinf.trace.rawtrace`.
Sequences run one after the other (batch size 1) through one cache tier of `capacity` experts that
stays warm across sequences. Per step, layers run in order; at (step s, layer l):

1. the router: the experts with a count > 0 are accessed and protected while layer l runs; the
   running sequence's EAM gains counts[s, l];
2. a resident expert is a hit; a missing one is fetched on demand, ahead of every prefetch, stalling
   the computation for its (remaining) transfer time, and inserted, evicting the policy's victim;
3. the prefetch policy plans (after every layer, or once per pass without refinement); its first
   `prefetch_depth` experts that are not resident replace the transfer queue (the transfer in flight
   continues); queued experts of a layer that has already run in this pass are skipped; at most
   `prefetch_depth` prefetched experts wait unused for a later layer of this pass (the window);
4. layer l computes for one time unit while the transfer channel moves `bandwidth` experts, highest
   priority first; a completed prefetch is inserted like a miss, except that it never evicts an
   unused prefetch of a layer still ahead in this pass (it is dropped if nothing else can go).

Prefetch recall = accesses served by an expert that a prefetch brought in for this forward pass
(resident in time, first use) / all accesses. Prefetch precision = completed prefetches used in
their pass / completed prefetches (1 - precision is the wasted bandwidth). Prediction recall =
accesses whose expert the latest plan listed for that layer / all accesses, whatever the timing.
`prefetch_depth` defaults to a quarter of the capacity, so unused prefetches cannot crowd the
sequence's own experts out of the cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from . import kernels
from .base import EvictionContext, EvictionPolicy, Key, PolicyError, PrefetchPolicy

Matcher = Callable[[np.ndarray, int], np.ndarray | None]
"""(partial EAM [L, E], number of leading layers observed) -> predicted EAM [L, E] or None."""


@dataclass(frozen=True)
class SimResult:
    """Counters of one replay; ratios are 0 when their denominator is."""

    eviction: str
    prefetch: str
    capacity: int
    refine: bool
    bandwidth: float
    accesses: int
    hits: int
    misses: int
    hit_ratio: float
    prefetch_recall: float
    """Accesses served by a prefetched expert on its first use / accesses."""
    prediction_recall: float
    """Accesses whose expert the latest plan listed for that layer / accesses."""
    prefetch_precision: float
    """Completed prefetches used before their eviction / completed prefetches."""
    prefetches: int
    prefetches_used: int
    prefetches_dropped: int
    stall: float
    """Time spent waiting for demand fetches, in layer-compute units."""
    compute: float
    """Time spent computing, in layer-compute units (one per layer per step)."""


def bandwidth_in_experts(gbps: float, expert_bytes: int, layer_seconds: float) -> float:
    """Experts transferred during one layer's compute time at `gbps` GB/s (10^9 bytes per second)."""
    if gbps <= 0 or expert_bytes <= 0 or layer_seconds <= 0:
        raise PolicyError(f"bandwidth, expert size and layer time must be > 0, got {gbps}, {expert_bytes}, "
                          f"{layer_seconds}")
    return gbps * 1e9 * layer_seconds / expert_bytes


class NearestEAM:
    """A matcher without clustering: the EAM of `eams` nearest to the partial EAM by Eq. 1, over the
    observed layers (an EAMC whose capacity is the whole dataset). Use it as `matcher=`."""

    def __init__(self, eams: np.ndarray | Sequence[np.ndarray]) -> None:
        self.eams = np.asarray(eams, dtype=np.float64)  # [N, L, E]
        if self.eams.ndim != 3 or len(self.eams) == 0:
            raise PolicyError(f"NearestEAM: expected a non-empty [N, L, E] array of EAMs, "
                              f"got {self.eams.shape}")
        norms = np.linalg.norm(self.eams, axis=2, keepdims=True)  # [N, L, 1]
        self._unit = np.divide(self.eams, norms, out=np.zeros_like(self.eams), where=norms > 0)

    def __call__(self, partial: np.ndarray, observed_layers: int) -> np.ndarray:
        rows = np.asarray(partial, dtype=np.float64)[:observed_layers]  # [O, E]
        norms = np.linalg.norm(rows, axis=1, keepdims=True)
        unit = np.divide(rows, norms, out=np.zeros_like(rows), where=norms > 0)
        similarity = np.einsum("nle,le->n", self._unit[:, :observed_layers], unit)  # [N]
        return self.eams[int(np.argmax(similarity))]


def eams_of(traces: Sequence[np.ndarray]) -> np.ndarray:
    """The final EAM of each sequence, [N, L, E]: its counts summed over the steps."""
    return np.stack([np.asarray(trace).sum(axis=0) for trace in traces]).astype(np.float32)


@dataclass(frozen=True)
class Accesses:
    """Traces flattened into layer visits, the input of the compiled demand replay (`kernels.replay`).

    Visit v is (sequence, step, layer) in compute order; it accesses the flat keys
    `keys[visit_start[v]:visit_start[v + 1]]` (layer * E + expert, ascending) with `tokens` routed to
    each. `next_visit[a]` is the visit of the next access to the key of access a (`kernels.NEVER` if
    none), what Belady's oracle knows. Build once with `Accesses.of(traces)` and replay it many times.
    """

    num_layers: int
    num_experts: int
    keys: np.ndarray  # [A] int64
    tokens: np.ndarray  # [A] float64
    visit_start: np.ndarray  # [V + 1] int64
    visit_layer: np.ndarray  # [V] int64
    new_sequence: np.ndarray  # [V] bool
    next_visit: np.ndarray  # [A] int64

    @classmethod
    def of(cls, traces: Sequence[np.ndarray]) -> Accesses:
        """Flatten `traces` (each [S, L, E] token counts, all with the same L and E)."""
        arrays = [np.asarray(trace) for trace in traces]
        shapes = {trace.shape[1:] for trace in arrays}
        if len(shapes) != 1 or any(trace.ndim != 3 for trace in arrays):
            raise PolicyError(f"traces must all be [S, L, E] arrays with the same L and E, got shapes "
                              f"{sorted({trace.shape for trace in arrays})}")
        num_layers, num_experts = shapes.pop()
        keys, tokens, visits, new_sequence = [], [], [], []
        offset = 0
        for trace in arrays:
            steps, layers, experts = np.nonzero(trace)  # C order: the compute order of the visits
            visits.append(offset + steps * num_layers + layers)
            keys.append(layers * num_experts + experts)
            tokens.append(trace[steps, layers, experts])
            first = np.zeros(trace.shape[0] * num_layers, dtype=bool)
            first[:1] = True
            new_sequence.append(first)
            offset += trace.shape[0] * num_layers
        visit = np.concatenate(visits).astype(np.int64) if visits else np.zeros(0, dtype=np.int64)
        key = np.concatenate(keys).astype(np.int64) if keys else np.zeros(0, dtype=np.int64)
        visit_start = np.zeros(offset + 1, dtype=np.int64)
        np.cumsum(np.bincount(visit, minlength=offset), out=visit_start[1:])
        # next access of the same key: sort the accesses by key, stably (they are in time order)
        order = np.argsort(key, kind="stable")
        same = key[order[1:]] == key[order[:-1]]
        next_visit = np.full(key.size, kernels.NEVER, dtype=np.int64)
        next_visit[order[:-1][same]] = visit[order[1:][same]]
        return cls(num_layers, num_experts, key,
                   np.concatenate(tokens).astype(np.float64) if tokens else np.zeros(0),
                   visit_start, np.arange(offset, dtype=np.int64) % num_layers,
                   np.concatenate(new_sequence) if new_sequence else np.zeros(0, dtype=bool), next_visit)

    @property
    def busiest(self) -> int:
        """The most experts one layer visit needs at once: the smallest possible cache."""
        return int(np.diff(self.visit_start).max(initial=0))


class _Replay:
    """The state of one replay with a prefetcher (Python; the demand-only replay is `kernels.replay`,
    with the same demand semantics); `simulate` is its public face."""

    def __init__(self, accesses: Accesses, capacity: int, eviction: EvictionPolicy,
                 prefetch: PrefetchPolicy | None, matcher: Matcher | None, bandwidth: float,
                 depth: int) -> None:
        self.accesses = accesses
        self.num_layers, self.num_experts = accesses.num_layers, accesses.num_experts
        self.capacity = capacity
        self.eviction = eviction
        self.prefetch = prefetch
        self.matcher = matcher
        self.bandwidth = bandwidth
        self.depth = depth
        self.resident: dict[Key, None] = {}
        self.unused_prefetch: set[Key] = set()
        self.queue: list[Key] = []
        self.queue_pos = 0
        self.inflight: Key | None = None
        self.progress = 0.0
        self.planned: dict[int, set[Key]] = {}
        self.counts = dict.fromkeys(("accesses", "hits", "predicted", "prefetches", "used", "dropped"), 0)
        self.stall = 0.0
        self.compute = 0.0
        self.next_use = (np.full(self.num_layers * self.num_experts, kernels.NEVER, dtype=np.int64)
                         if eviction.needs_future else None)

    def run(self) -> None:
        acc = self.accesses
        eam = np.zeros((self.num_layers, self.num_experts), dtype=np.float64)  # the running sequence's
        step = -1
        for visit, layer in enumerate(acc.visit_layer.tolist()):
            if acc.new_sequence[visit]:
                eam.fill(0.0)
                step = -1
                self.planned, self.queue, self.queue_pos = {}, [], 0
            step += layer == 0
            span = slice(acc.visit_start[visit], acc.visit_start[visit + 1])
            if self.next_use is not None:
                self.next_use[acc.keys[span]] = acc.next_visit[span]
            experts = (acc.keys[span] - layer * self.num_experts).tolist()
            eam[layer, experts] += acc.tokens[span]
            self._visit(step, layer, [(layer, e) for e in experts], eam)

    def _visit(self, step: int, layer: int, accessed: list[Key], eam: np.ndarray) -> None:
        if layer == 0:
            # a prefetch serves the pass it was planned for; left unused, it is plain cache content now
            self.unused_prefetch.clear()
        ctx = EvictionContext(cur_eam=eam, layer=layer, protected=frozenset(accessed), next_use=self.next_use)
        planned = self.planned.pop(layer, set())
        missing = [key for key in accessed if key not in self.resident]
        for key in accessed:
            self.counts["accesses"] += 1
            self.counts["predicted"] += key in planned
            if key in self.resident:
                self.counts["hits"] += 1
                if key in self.unused_prefetch:
                    self.unused_prefetch.discard(key)
                    self.counts["used"] += 1
            else:
                remaining = 1.0
                if key == self.inflight:
                    remaining, self.inflight, self.progress = 1.0 - self.progress, None, 0.0
                self.stall += remaining / self.bandwidth if math.isfinite(self.bandwidth) else 0.0
        # the misses are inserted together, as in kernels.replay: victims chosen at once
        self._evict(len(self.resident) + len(missing) - self.capacity, ctx)
        for key in missing:
            self.resident[key] = None
            self.eviction.on_insert(key)
        for key in accessed:
            self.eviction.on_access(key)
        if self.prefetch is not None and self.prefetch.should_plan(layer):
            observed = layer + 1 if step == 0 else self.num_layers
            matched = self.matcher(eam, observed) if self.matcher is not None else None
            plan = self.prefetch.plan(layer, eam, matched)
            self.queue = [key for key, _ in plan if key not in self.resident][: self.depth]
            self.queue_pos = 0
            self.planned = {}
            for key, _ in plan:
                self.planned.setdefault(key[0], set()).add(key)
        self.compute += 1.0
        if self.prefetch is not None:
            self._transfer(self.bandwidth, ctx)

    def _evict(self, count: int, ctx: EvictionContext) -> None:
        if count <= 0:
            return
        victims = self.eviction.victims(ctx, count)
        assert len(victims) == count, "simulate checks that the capacity holds the busiest visit"
        for victim in victims:
            del self.resident[victim]
            self.unused_prefetch.discard(victim)
            self.eviction.on_evict(victim)

    def _insert(self, key: Key, ctx: EvictionContext) -> None:
        self._evict(len(self.resident) + 1 - self.capacity, ctx)
        self.resident[key] = None
        self.eviction.on_insert(key)

    def _transfer(self, budget: float, ctx: EvictionContext) -> None:
        """Move `budget` experts' worth of bytes through the channel, in queue order."""
        # a prefetch must not displace an unused prefetch of a layer still ahead in this pass: it has
        # no count in cur_eam yet, so Algorithm 2 would pick it first and prefetches would evict each other
        ahead = frozenset(key for key in self.unused_prefetch if key[0] > ctx.layer)
        guarded = EvictionContext(cur_eam=ctx.cur_eam, layer=ctx.layer, protected=ctx.protected | ahead,
                                  next_use=ctx.next_use)
        while budget > 0:
            if len(guarded.protected) - len(ctx.protected) >= self.depth:
                return  # the prefetch window is full: wait until the computation uses some
            if self.inflight is None:
                # skip what arrived meanwhile and what is stale: its layer already ran in this pass
                while self.queue_pos < len(self.queue) and (self.queue[self.queue_pos] in self.resident
                                                           or self.queue[self.queue_pos][0] <= ctx.layer):
                    self.queue_pos += 1
                if self.queue_pos == len(self.queue):
                    return  # idle: nothing left worth fetching
                self.inflight, self.progress = self.queue[self.queue_pos], 0.0
                self.queue_pos += 1
            need = 1.0 - self.progress
            if budget < need:
                self.progress += budget
                return
            budget -= need
            key, self.inflight, self.progress = self.inflight, None, 0.0
            if key in self.resident:
                continue
            if len(self.resident) >= self.capacity and all(k in guarded.protected for k in self.resident):
                self.counts["dropped"] += 1
                continue
            self._insert(key, guarded)
            self.counts["prefetches"] += 1
            self.unused_prefetch.add(key)
            guarded = EvictionContext(cur_eam=ctx.cur_eam, layer=ctx.layer,
                                      protected=guarded.protected | {key}, next_use=ctx.next_use)

    def result(self) -> SimResult:
        c = self.counts
        accesses = c["accesses"]
        return SimResult(
            eviction=self.eviction.name,
            prefetch=self.prefetch.name if self.prefetch is not None else "none",
            capacity=self.capacity,
            refine=self.prefetch.refine if self.prefetch is not None else True,
            bandwidth=self.bandwidth,
            accesses=accesses,
            hits=c["hits"],
            misses=accesses - c["hits"],
            hit_ratio=c["hits"] / accesses if accesses else 0.0,
            prefetch_recall=c["used"] / accesses if accesses else 0.0,
            prediction_recall=c["predicted"] / accesses if accesses else 0.0,
            prefetch_precision=c["used"] / c["prefetches"] if c["prefetches"] else 0.0,
            prefetches=c["prefetches"],
            prefetches_used=c["used"],
            prefetches_dropped=c["dropped"],
            stall=self.stall,
            compute=self.compute,
        )


def simulate(traces: Sequence[np.ndarray] | Accesses, capacity: int, eviction: EvictionPolicy,
             prefetch: PrefetchPolicy | None = None, *, matcher: Matcher | None = None,
             bandwidth: float = math.inf, prefetch_depth: int | None = None,
             counts: np.ndarray | None = None, firsts: np.ndarray | None = None) -> SimResult:
    """Replay `traces` (each [S, L, E] token counts, or their `Accesses`) through a cache of `capacity`
    experts.

    `eviction` and `prefetch` are fresh or reset policy objects (the eviction policy is reset here);
    `matcher` gives the activation-aware prefetcher its matched EAM (e.g. `NearestEAM`, or an EAMC's
    match); `bandwidth` is in experts per layer-compute time (see `bandwidth_in_experts`; inf = a
    prefetch completes at once). `counts` ([L, E] accesses seen before, e.g. by the sequences an EAMC
    was built from) seeds the eviction policy's access counts, `firsts` ([L, E] how many of them used each
    expert) its first uses (`EvictionPolicy.reset`).
    `capacity` must hold the experts of the busiest layer visit. Without a
    prefetcher the replay is the compiled `kernels.replay` (same policy state, same victims as the
    Python replay with `make_prefetch("none")`, much faster).
    """
    accesses = traces if isinstance(traces, Accesses) else Accesses.of(traces)
    if capacity < 1:
        raise PolicyError(f"capacity must be >= 1 expert, got {capacity}")
    if not bandwidth > 0:
        raise PolicyError(f"bandwidth must be > 0 experts per layer time, got {bandwidth}")
    if (accesses.num_layers, accesses.num_experts) != (eviction.num_layers, eviction.num_experts):
        raise PolicyError(f"the traces have {accesses.num_layers} x {accesses.num_experts} experts, the "
                          f"eviction policy {eviction.num_layers} x {eviction.num_experts}")
    busiest = accesses.busiest
    if busiest > capacity:
        raise PolicyError(f"capacity {capacity} cannot hold the {busiest} experts one layer needs at once; "
                          f"raise the cache size to at least {busiest} experts")
    if prefetch is not None and prefetch.name == "activation-aware" and matcher is None:
        raise PolicyError("activation-aware prefetch needs a matcher "
                          "(e.g. NearestEAM(train_eams) or an EAMC's match)")
    eviction.reset(counts, firsts)
    if prefetch is None:
        return _replay_demand(accesses, capacity, eviction)
    depth = prefetch_depth if prefetch_depth is not None else max(1, capacity // 4)
    replay = _Replay(accesses, capacity, eviction, prefetch, matcher, bandwidth, depth)
    replay.run()
    return replay.result()


def _replay_demand(accesses: Accesses, capacity: int, eviction: EvictionPolicy) -> SimResult:
    hits, misses = kernels.replay(
        eviction.kind, eviction.params, accesses.num_layers, capacity, accesses.keys, accesses.tokens,
        accesses.visit_start, accesses.visit_layer, accesses.new_sequence, accesses.next_visit,
        eviction.stamp, eviction.count, eviction.resident, eviction.clock, eviction.alphas, eviction.loglik,
        eviction.running, eviction.layer_state, eviction.transition, eviction.flags)
    assert hits >= 0, "simulate checks that the capacity holds the busiest visit"
    total = hits + misses
    return SimResult(eviction=eviction.name, prefetch="none", capacity=capacity, refine=True,
                     bandwidth=math.inf, accesses=total, hits=hits, misses=misses,
                     hit_ratio=hits / total if total else 0.0, prefetch_recall=0.0, prediction_recall=0.0,
                     prefetch_precision=0.0, prefetches=0, prefetches_used=0, prefetches_dropped=0,
                     stall=0.0, compute=float(accesses.visit_layer.size))
