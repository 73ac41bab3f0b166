"""The device tier: fixed slots on the compute device, filled host -> device by copy workers.

It stands between the engine's host pool (SSD -> host, the engine's I/O threads) and compute. A claim
(`submit`) queues a copy job by priority and starts the job's SSD -> host read at once if the host tier
has room, so reads of queued jobs overlap the copies in progress. Two workers take jobs: one serves only
demand jobs (MAX priority), the other any job, so a demand never waits behind a prefetch whose read is
slow. A worker makes room in the host tier if needed (releasing the least recently used host copy that no
job needs; a release never blocks), waits for the host read without any lock held, and issues the copy
(`Copier`). Host copies stay after the device copy (the host is the second-level cache) until the host
needs their slot.

A demand claim of a key already claimed is promoted wherever it is: a queued job moves to the front (and
its host read to MAX in the engine), a job being copied gets its host read raised to MAX.

A failed read (or copy) is handed to the key's `wait`, after which the key is no longer claimed: its
device slot is free and its host read released, so the next `submit` retries it.

On CUDA the slots are device memory and copies run on a side stream from page-locked memory, one event per
copy (several in flight); on a CPU machine the same class is a second, separately budgeted CPU tier whose
copies are synchronous (what the tests exercise).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections import OrderedDict

import torch

from ..engine import MAX_PRIORITY
from ..policy import Key
from ..store.safetensors_file import torch_dtype
from .copier import Copier, Event
from .tiers import HostTier, Tier

log = logging.getLogger(__name__)


class DeviceTier(Tier):
    """`capacity` slots of `slot_bytes` on `device`, fed from `host` (a `HostTier` of its own budget)."""

    name = "device"
    reads_from_disk = False

    def __init__(self, host: HostTier, store: object, capacity: int, slot_bytes: int,
                 device: torch.device) -> None:
        self.host = host
        self.store = store
        self.capacity = capacity
        self.device = device
        self._copier = Copier(device, host.engine.regions(), slot_bytes)
        # Free slots, each with the event after which compute no longer reads it (None: free now).
        self._free: list[tuple[torch.Tensor, Event]] = [
            (torch.empty(slot_bytes, dtype=torch.uint8, device=device), None) for _ in range(capacity)]
        self._slots: dict[Key, torch.Tensor] = {}
        self._copied: dict[Key, Event] = {}  # copies issued and maybe still running (their host source busy)
        self._views: dict[Key, dict[str, torch.Tensor]] = {}
        self._jobs: list[tuple[float, int, Key]] = []  # heap of (-priority, order, key)
        self._queued: dict[Key, float] = {}
        self._copying: dict[Key, float] = {}  # jobs a worker took: waiting for the host read, or copying
        self._host_keys: OrderedDict[Key, None] = OrderedDict()  # host-resident or reading, LRU first
        self._errors: dict[Key, BaseException] = {}
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self.copies = 0
        self.disk_reads = 0
        self.bytes_read = 0
        self._workers = [
            threading.Thread(target=self._work, args=(demand_only,), daemon=True,
                             name=f"moeinf-device-copy-{'demand' if demand_only else 'any'}")
            for demand_only in (True, False)]
        for worker in self._workers:
            worker.start()

    # --- host tier ---------------------------------------------------------------------------------
    def in_host(self, key: Key) -> bool:
        with self._cond:
            return key in self._host_keys and self.host.is_resident(key)

    def stage(self, key: Key, priority: float) -> bool:
        """Prefetch into the host tier only (no device slot); False when the host has no room to spare."""
        with self._cond:
            if key in self._host_keys:
                self._host_keys.move_to_end(key)
                return True
            return self._host_read(key, priority, evict=False)

    def _host_read(self, key: Key, priority: float, *, evict: bool) -> bool:
        """Start the SSD -> host read of `key`, first releasing a host copy if `evict`; never blocks."""
        if len(self._host_keys) >= self.host.capacity:
            if not evict:
                return False
            victim = next((k for k in self._host_keys if self._evictable(k)), None)
            if victim is None:
                return False
            del self._host_keys[victim]
            self.host.release(victim)  # a read still in flight is dropped when its chunk lands
        self.host.submit(key, priority)
        self._host_keys[key] = None
        self.disk_reads += 1
        self.bytes_read += self.store.entry(*key).size
        return True

    def _evictable(self, key: Key) -> bool:
        """A host copy no job needs and no running copy reads."""
        if key in self._queued or key in self._copying:
            return False
        event = self._copied.get(key)
        if event is not None and not self._copier.done(event):
            return False
        self._copied.pop(key, None)
        return True

    # --- Tier --------------------------------------------------------------------------------------
    def submit(self, key: Key, priority: float) -> None:
        with self._cond:
            if key in self._slots:
                return
            if key in self._copying:
                # A worker holds the job (one slot per key): only its host read can still be raised.
                if priority > self._copying[key]:
                    self._copying[key] = priority
                    self.host.submit(key, priority)
                return
            self._errors.pop(key, None)  # a new claim of a failed key retries it
            self._queued[key] = priority
            heapq.heappush(self._jobs, (-priority, next(self._order), key))
            if key in self._host_keys:
                self.host.submit(key, priority)  # re-prioritise (or retry) its read; no-op when resident
            else:
                self._host_read(key, priority, evict=False)  # overlap: start the read if the host has room
            self._cond.notify_all()

    def cancel(self, key: Key) -> bool:
        with self._cond:
            if self._errors.pop(key, None) is not None:
                return True  # a failed claim: nothing in flight, no slot held
            return self._queued.pop(key, None) is not None

    def is_resident(self, key: Key) -> bool:
        with self._cond:
            return key in self._slots

    def wait(self, key: Key) -> dict[str, torch.Tensor]:
        with self._cond:
            while key not in self._slots and key not in self._errors:
                if key not in self._queued and key not in self._copying:
                    raise KeyError(f"expert {key} is neither resident nor claimed in the device tier")
                self._cond.wait()
            if key in self._errors:
                raise self._errors.pop(key)
            views = self._views.get(key)
            if views is None:
                views = self._views[key] = self._tensors(key, self._slots[key])
            event = self._copied.get(key)
        self._copier.use(event)  # compute waits for this copy only (on the device, not on the host)
        return views

    def release(self, key: Key) -> None:
        with self._cond:
            self._views.pop(key, None)
            self._free.append((self._slots.pop(key), self._copier.released()))
            # A worker may be waiting for a free slot to start a job queued before this release.
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for worker in self._workers:
            worker.join()
        self._copier.close()
        self.host.close()

    # --- copy workers ------------------------------------------------------------------------------
    def _take_job(self, demand_only: bool) -> tuple[Key, torch.Tensor, Event] | None:
        """The best queued job this worker may serve, with a free slot and its host read started."""
        with self._cond:
            while not self._closed:
                while self._jobs and self._queued.get(self._jobs[0][2]) != -self._jobs[0][0]:
                    heapq.heappop(self._jobs)  # cancelled, or superseded by a re-prioritised entry
                if self._jobs and self._free:
                    key = self._jobs[0][2]
                    priority = self._queued[key]
                    if demand_only and priority < MAX_PRIORITY:
                        self._cond.wait()
                        continue
                    if key in self._host_keys or self._host_read(key, priority, evict=True):
                        heapq.heappop(self._jobs)
                        del self._queued[key]
                        self._copying[key] = priority
                        self._host_keys.move_to_end(key)
                        slot, free_after = self._free.pop()
                        return key, slot, free_after
                    # Every host slot is needed by a job or a running copy: wait for one to finish.
                self._cond.wait()
            return None

    def _work(self, demand_only: bool) -> None:
        while True:
            job = self._take_job(demand_only)
            if job is None:
                return
            key, slot, free_after = job
            try:
                buffer = self.host.engine.wait(key[0], key[1])  # no lock held: compute keeps going
                event = self._copier.copy(slot, torch.frombuffer(buffer, dtype=torch.uint8), free_after)
            except Exception as exc:  # re-raised by wait(key) in the compute thread
                with self._cond:
                    # Unclaim it everywhere, so that the next submit reads it again.
                    self._errors[key] = exc
                    self._free.append((slot, free_after))
                    del self._copying[key]
                    if key in self._host_keys:
                        del self._host_keys[key]
                        self.host.release(key)  # failed: back to idle in the engine
                    self._cond.notify_all()
                continue
            with self._cond:
                del self._copying[key]
                self._slots[key] = slot
                if event is not None:
                    self._copied[key] = event
                self.copies += 1
                self._cond.notify_all()

    def _tensors(self, key: Key, slot: torch.Tensor) -> dict[str, torch.Tensor]:
        entry = self.store.entry(*key)
        out: dict[str, torch.Tensor] = {}
        for name, t in entry.tensors.items():
            dtype = torch_dtype(t.dtype)
            numel = 1
            for dim in t.shape:
                numel *= dim
            nbytes = numel * dtype.itemsize
            out[name] = slot[t.offset: t.offset + nbytes].view(dtype).view(t.shape)
        return out
