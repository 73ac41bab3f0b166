"""Giving freed memory back to the system when the server goes idle.

Why the server's resident memory grew burst after burst without a leak: every decode step allocates
tensors whose sizes change with the batch (KV caches as wide as the longest row, [rows, vocab] logits,
activations), and glibc's malloc serves them from its heaps. glibc raises its mmap threshold each time an
mmapped block is freed (up to 32 MiB on 64-bit), so after the first large frees such tensors come from the
heap arenas instead of their own mappings; freed, they stay in the arenas as free chunks that the next,
differently sized batch cannot always reuse, and glibc returns to the system only what lies at the top of
a heap. Resident memory therefore climbs toward a fragmented high-water mark: in the fault trial, 524 to
1,545 MB over 17 bursts of 64 requests, flattening, and `malloc_trim` gave back 370 MB at once.

`release_free_memory` calls `malloc_trim(0)`, which returns every whole free page of every arena (not only
the top of the heap). The batcher calls it when it becomes idle after serving requests, at most once per
`min_interval_s`, so a burst's freed memory goes back before the next burst and a steady load pays
nothing. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
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
        self._last = 0.0

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
