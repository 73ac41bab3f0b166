"""Giving freed memory back to the system when the server goes idle.

Why the server's resident memory grows over bursts of requests (measured with glibc's `mallinfo2` between
bursts of `moeinf bench soak` on the zoo model; figures in docs/benchmarks.md):

- most of it is memory the program has freed but glibc keeps: every decode step allocates tensors whose
  sizes change with the batch (KV caches as wide as the longest row, [rows, vocab] logits, activations).
  glibc raises its mmap threshold each time an mmapped block is freed (up to 32 MiB on 64-bit), so after
  the first large frees such tensors come from the heap arenas, and freed chunks stay there: glibc gives
  back on its own only what lies at the top of a heap. The high-water mark of the largest burst so far
  stays resident.
- the rest is in use and bounded: oneDNN's primitive cache (one compiled kernel per matmul shape, up to
  its capacity, 1024 by default), the MLA expanded keys and values a model keeps between steps (at most
  `OffloadConfig.mla_expanded_max_bytes`), torch's and the runtime's own pools.

`release_free_memory` calls `malloc_trim(0)`, which returns every whole free page of every arena (not only
the top of the heap). The batcher calls it when it becomes idle after serving requests, at most once per
`min_interval_s`, so a burst's freed memory goes back before the next burst and a steady load pays
nothing. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import time

log = logging.getLogger(__name__)

_trim = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim = _libc.malloc_trim
    _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
except (OSError, AttributeError):  # not glibc: nothing to call
    _trim = None


def available() -> bool:
    """True where `release_free_memory` can give memory back (glibc)."""
    return _trim is not None


def release_free_memory() -> bool:
    """Return the allocator's free pages to the system; True when some were returned."""
    if _trim is None:
        return False
    return bool(_trim(0))


class IdleTrimmer:
    """Calls `release_free_memory` when the server becomes idle after work, at most once per
    `min_interval_s` (`Batcher`)."""

    def __init__(self, enabled: bool = True, min_interval_s: float = 1.0):
        self.enabled = enabled and available()
        self.min_interval_s = min_interval_s
        self.trims = 0
        self._busy = False
        self._last = -math.inf  # the first trim never waits (monotonic time may start near 0 at boot)

    def busy(self) -> None:
        """Work was done since the last idle moment."""
        self._busy = True

    def idle(self) -> None:
        """Nothing runs or waits now: trim once if work was done since the last trim."""
        if not (self.enabled and self._busy):
            return
        now = time.monotonic()
        if now - self._last < self.min_interval_s:
            return
        self._busy, self._last = False, now
        released = release_free_memory()
        self.trims += 1
        log.debug("idle: malloc_trim %s", "released memory" if released else "had nothing to release")
