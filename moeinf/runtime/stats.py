"""Counters of one runtime: hits and misses per tier, prefetch quality, bytes read, time stalled.

Definitions (the test-suite checks them):
- an *access* is one expert needed by one layer of one forward pass; `hits + misses == accesses` per tier
  that serves compute (`device`); a device miss found in the host tier is a `host` hit, else a disk read.
- a *useful* prefetch is an expert brought in (or in flight) by a prefetch and accessed before it left.
  `prefetch_precision = useful / prefetches issued`; `prefetch_recall = useful / (useful + demand misses)`,
  the share of the accesses that would have read from disk which prefetching covered.
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
            "reads": self.reads,
            "bytes_read": self.bytes_read,
            "device_copies": self.device_copies,
            "evictions": self.evictions,
            "stall_s": self.stall_s,
            "tokens": self.tokens,
            "forward_passes": self.forward_passes,
        }
