"""The device tier: fixed slots on the compute device, filled host -> device by a copy thread.

It stands between the engine's host pool (SSD -> host, the engine's I/O threads) and compute. A claim
(`submit`) queues a copy job by priority; the copy thread makes the expert resident in the host tier
(submitting its read if needed, evicting the least recently used host copy that no job needs), waits
for it and copies its bytes into a free device slot. SSD -> host reads of queued jobs are submitted as
soon as the host has room, so they overlap the copies in progress. Host copies stay after the device
copy (the host is the second-level cache) until the host needs their slot.

On CUDA the slots are device memory; on a CPU machine the same class is a second, separately budgeted
CPU tier (what the tests exercise).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections import OrderedDict

import torch

from ..policy import Key
from ..store.safetensors_file import torch_dtype
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
        self._free = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(capacity)]
        self._slots: dict[Key, torch.Tensor] = {}
        self._views: dict[Key, dict[str, torch.Tensor]] = {}
        self._jobs: list[tuple[float, int, Key]] = []  # heap of (-priority, order, key)
        self._queued: dict[Key, float] = {}
        self._host_keys: OrderedDict[Key, None] = OrderedDict()  # host-resident or reading, LRU first
        self._copying: Key | None = None
        self._errors: dict[Key, BaseException] = {}
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self.copies = 0
        self.disk_reads = 0
        self.bytes_read = 0
        self._thread = threading.Thread(target=self._copy_loop, name="moeinf-device-copy", daemon=True)
        self._thread.start()

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
        if len(self._host_keys) >= self.host.capacity:
            needed = set(self._queued) | {self._copying}
            victims = [k for k in self._host_keys if k not in needed]
            if not evict or not victims:
                return False
            victim = victims[0]
            del self._host_keys[victim]
            if not self.host.cancel(victim):
                self.host.wait(victim)
                self.host.release(victim)
        self.host.submit(key, priority)
        self._host_keys[key] = None
        self.disk_reads += 1
        self.bytes_read += self.store.entry(*key).size
        return True

    # --- Tier --------------------------------------------------------------------------------------
    def submit(self, key: Key, priority: float) -> None:
        with self._cond:
            if key in self._slots or key == self._copying:
                # Resident, or being copied now: a second job would copy it into a second slot and leak
                # the first (a CI run deadlocked on a full tier that the cache believed had room).
                return
            self._queued[key] = priority
            heapq.heappush(self._jobs, (-priority, next(self._order), key))
            if key in self._host_keys:
                self.host.submit(key, priority)  # re-prioritise a read in flight; no-op when resident
            else:
                self._host_read(key, priority, evict=False)  # overlap: start the read if the host has room
            self._cond.notify_all()

    def cancel(self, key: Key) -> bool:
        with self._cond:
            return self._queued.pop(key, None) is not None

    def is_resident(self, key: Key) -> bool:
        with self._cond:
            return key in self._slots

    def wait(self, key: Key) -> dict[str, torch.Tensor]:
        with self._cond:
            while key not in self._slots and key not in self._errors:
                if key not in self._queued and self._copying != key:
                    raise KeyError(f"expert {key} is neither resident nor claimed in the device tier")
                self._cond.wait()
            if key in self._errors:
                raise self._errors.pop(key)
            views = self._views.get(key)
            if views is None:
                views = self._views[key] = self._tensors(key, self._slots[key])
            return views

    def release(self, key: Key) -> None:
        with self._cond:
            self._views.pop(key, None)
            self._free.append(self._slots.pop(key))
            # The copy thread may be waiting for a free slot to start a job queued before this release.
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        self.host.close()

    # --- copy thread -------------------------------------------------------------------------------
    def _next_job(self) -> Key | None:
        with self._cond:
            while not self._closed:
                while self._jobs and self._queued.get(self._jobs[0][2]) != -self._jobs[0][0]:
                    heapq.heappop(self._jobs)  # cancelled, or superseded by a re-prioritised entry
                if self._jobs and self._free:
                    _, _, key = heapq.heappop(self._jobs)
                    priority = self._queued.pop(key)
                    if key in self._slots:
                        continue  # already copied: one slot per key
                    self._copying = key
                    if key not in self._host_keys and not self._host_read(key, priority, evict=True):
                        raise RuntimeError("the host tier has no slot to stage a copy; raise host_cache")
                    self._host_keys.move_to_end(key)
                    return key
                self._cond.wait()
            return None

    def _copy_loop(self) -> None:
        while True:
            try:
                key = self._next_job()
            except BaseException as exc:  # handed to the waiter of the key being staged
                with self._cond:
                    self._errors[self._copying] = exc
                    self._copying = None
                    self._cond.notify_all()
                continue
            if key is None:
                return
            try:
                buffer = self.host.engine.wait(key[0], key[1])
                src = torch.frombuffer(buffer, dtype=torch.uint8)
                with self._cond:
                    slot = self._free.pop()
                slot[: src.numel()].copy_(src)
                with self._cond:
                    self._slots[key] = slot
                    self.copies += 1
            except BaseException as exc:  # re-raised by wait(key) in the compute thread
                with self._cond:
                    self._errors[key] = exc
            with self._cond:
                self._copying = None
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
