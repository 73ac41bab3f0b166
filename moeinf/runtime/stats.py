"""Counters of one runtime: hits and misses per tier, prefetch quality, bytes read, time stalled.

Definitions (the test-suite checks them):
- an *access* is one expert needed by one layer of one forward pass; `hits + misses == accesses` per tier
  that serves compute (`device`); a device miss found in the host tier is a `host` hit, else a disk read.
- a *useful* prefetch is an expert brought in (or in flight) by a prefetch and accessed before it left.
  `prefetch_precision = useful / prefetches issued`; `prefetch_recall = useful / (useful + demand misses)`,
  the share of the accesses that would have read from disk which prefetching covered.
- where prefetches go: `late_prefetches` were still in flight when accessed (useful, yet compute waited),
  `cancelled_prefetches` were dropped from a later plan before they landed, `unused_evictions` were evicted
  before any access used them; `paced_out` counts plan entries the pacing cut (per refresh, so a key cut at
  several refreshes counts each time); `plans_held` the layers that made no plan because the latest one still
  served them (`OffloadConfig.prefetch_hold_plan`); `plans_beside_compute` the plans made on the planner
  thread while the layer's experts computed (`OffloadConfig.prefetch_plan_thread`);
  `demand_reads_by_layer` splits `demand_reads` by MoE layer.
- `bytes_read` counts the padded blob bytes of every completed disk read; `stall_s` the seconds compute
  waited for experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RuntimeStats:
    """Mutable counters; the runtime updates them under its lock."""

    accesses: int = 0
    hits: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})
    misses: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})
    prefetches: int = 0
    useful_prefetches: int = 0
    demand_reads: int = 0
    demand_reads_by_layer: dict[int, int] = field(default_factory=dict)
    late_prefetches: int = 0
    cancelled_prefetches: int = 0
    unused_evictions: int = 0
    paced_out: int = 0
    plans_held: int = 0
    plans_beside_compute: int = 0
    reads: int = 0
    bytes_read: int = 0
    device_copies: int = 0
    evictions: int = 0
    stall_s: float = 0.0
    tokens: int = 0
    forward_passes: int = 0

    def as_dict(self) -> dict[str, object]:
        covered = self.useful_prefetches + self.demand_reads
        return {
            "accesses": self.accesses,
            "hits": self.hits["device"],
            "misses": self.misses["device"],
            "hits_per_tier": dict(self.hits),
            "misses_per_tier": dict(self.misses),
            "hit_rate": self.hits["device"] / self.accesses if self.accesses else 0.0,
            "prefetches": self.prefetches,
            "useful_prefetches": self.useful_prefetches,
            "prefetch_precision": self.useful_prefetches / self.prefetches if self.prefetches else 0.0,
            "prefetch_recall": self.useful_prefetches / covered if covered else 0.0,
            "demand_reads": self.demand_reads,
            "demand_reads_by_layer": {str(layer): n
                                      for layer, n in sorted(self.demand_reads_by_layer.items())},
            "late_prefetches": self.late_prefetches,
            "cancelled_prefetches": self.cancelled_prefetches,
            "unused_evictions": self.unused_evictions,
            "paced_out": self.paced_out,
            "plans_held": self.plans_held,
            "plans_beside_compute": self.plans_beside_compute,
            "reads": self.reads,
            "bytes_read": self.bytes_read,
            "device_copies": self.device_copies,
            "evictions": self.evictions,
            "stall_s": self.stall_s,
            "tokens": self.tokens,
            "forward_passes": self.forward_passes,
        }
