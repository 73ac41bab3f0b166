"""Online adaptation of the EAMC to a shifting workload.

The runtime reports every finished sequence with its final EAM and the EAM it was predicted to follow
(the matched entry). While the collection holds fewer than `capacity` entries, every finished sequence
joins it (a process that starts without an EAMC is seeded by its first sequences and grows from there).
Once it is full, a sequence predicted worse than `threshold` (`eam.accuracy`) is kept; once
`rebuild_after` sequences are kept, a background thread rebuilds the EAMC with `capacity` entries from the
current entries plus the kept sequences, and swaps it in with one reference assignment. Readers take
`.current` and match against that immutable EAMC, so they never wait for a rebuild.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

from .eam import accuracy, flat_unit_rows
from .eamc import EAMC, distinct_count

log = logging.getLogger(__name__)

Builder = Callable[[np.ndarray, int, int], EAMC]
"""(eams [N, L, E], capacity, seed) -> EAMC; `EAMC.build` by default (tests inject slow builders)."""


def _default_builder(eams: np.ndarray, capacity: int, seed: int) -> EAMC:
    return EAMC.build(eams, capacity, seed=seed)


class OnlineEAMC:
    """An EAMC that rebuilds itself in the background from poorly predicted sequences.

    `current` always returns a complete EAMC. `report` is cheap and never blocks on a rebuild. A failed
    rebuild is re-raised by the next `report` or `wait` (never swallowed). `rebuild_after=0` disables
    rebuilding (sequences are still scored).
    """

    def __init__(self, eamc: EAMC, threshold: float = 0.5, rebuild_after: int = 16, *,
                 capacity: int | None = None, seed: int = 0, builder: Builder = _default_builder) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"online_threshold must lie in [0, 1], got {threshold}")
        if rebuild_after < 0:
            raise ValueError(f"online_rebuild_after must be >= 0, got {rebuild_after}")
        if capacity is not None and capacity < 1:
            raise ValueError(f"eamc_capacity must be >= 1, got {capacity}")
        self.capacity = eamc.capacity if capacity is None else capacity
        """Entries the collection grows to (finished sequences join it directly until then)."""
        self._current = eamc
        self.threshold = threshold
        self.rebuild_after = rebuild_after
        self.seed = seed
        self._builder = builder
        self._lock = threading.Lock()
        self._kept: list[np.ndarray] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.rebuilds = 0
        """Completed rebuilds (each swapped a new EAMC in)."""

    @property
    def current(self) -> EAMC:
        """The EAMC to match against now (an immutable object; safe to keep for a whole sequence)."""
        return self._current

    @property
    def pending(self) -> int:
        """Poorly predicted sequences kept for the next rebuild."""
        with self._lock:
            return len(self._kept)

    @property
    def rebuilding(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def report(self, seq_eam: np.ndarray, predicted: np.ndarray) -> float:
        """Score a finished sequence's prediction; add it while the collection is not full, else keep it
        when poorly predicted and maybe start a rebuild. -> accuracy."""
        self._raise_failure()
        score = accuracy(seq_eam, predicted)
        if self._grow(seq_eam):
            return score
        if score >= self.threshold or self.rebuild_after == 0:
            return score
        with self._lock:
            self._kept.append(np.asarray(seq_eam, dtype=np.float32).copy())
            if len(self._kept) < self.rebuild_after or self.rebuilding:
                return score
            kept, self._kept = self._kept, []
            self._thread = threading.Thread(target=self._rebuild, args=(self._current, kept),
                                            name="moeinf-eamc-rebuild", daemon=True)
            self._thread.start()
        return score

    def add(self, seq_eam: np.ndarray) -> bool:
        """Add a finished sequence that had no prediction; False when the collection is already full."""
        self._raise_failure()
        return self._grow(seq_eam)

    def _grow(self, seq_eam: np.ndarray) -> bool:
        with self._lock:
            current = self._current
            if current.capacity >= self.capacity or self.rebuilding:
                return False
            eams = np.concatenate([current.eams, np.asarray(seq_eam, dtype=np.float32)[None]])
            self._current = EAMC(eams, current.meta)  # one reference assignment, as a rebuild swaps
            return True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a running rebuild; True when none is running any more. Re-raises a rebuild failure."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        self._raise_failure()
        return not self.rebuilding

    def _rebuild(self, base: EAMC, kept: list[np.ndarray]) -> None:
        try:
            eams = np.concatenate([base.eams, np.stack(kept)])
            capacity = min(self.capacity, distinct_count(flat_unit_rows(eams)))
            log.info("rebuilding the EAMC from %d entries + %d poorly predicted sequences",
                     base.capacity, len(kept))
            fresh = self._builder(eams, capacity, self.seed + self.rebuilds + 1)
            fresh.meta.update({k: v for k, v in base.meta.items() if k not in fresh.meta},
                              online_rebuilds=self.rebuilds + 1)
            self._current = fresh  # one reference assignment: readers see the old or the new EAMC
            self.rebuilds += 1
        except BaseException as exc:  # handed to the caller's thread by _raise_failure
            log.exception("EAMC rebuild failed")
            self._error = exc

    def _raise_failure(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("the background EAMC rebuild failed; see the cause") from error
