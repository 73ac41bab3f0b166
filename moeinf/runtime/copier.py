"""Host -> device copies of expert blobs for the device tier, off the compute stream.

On CUDA each copy runs on a side stream from page-locked memory and records an event: several copies are
in flight at once, compute waits (on the device) only for the one it needs, and a slot given back is not
overwritten before the compute that read it has run. Page-locked means the engine's pool registered with
`cudaHostRegister` (the engine mlocks it); where registration fails, each copy goes through a pinned
bounce buffer, never straight from pageable memory. On a CPU device (the stand-in the tests run) a copy
is a plain synchronous `copy_` and every event is None (already complete).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

log = logging.getLogger(__name__)

Event = Any
"""A `torch.cuda.Event`, or None for a copy that is already complete."""


class Copier:
    """Copies for one device tier; `regions` are the (address, bytes) of the host pool the sources live in."""

    def __init__(self, device: torch.device, regions: list[tuple[int, int]], slot_bytes: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.slot_bytes = slot_bytes
        self._registered: list[int] = []
        self._bounce = threading.local()  # per worker: a pinned buffer and the event of its last copy
        if not self.cuda:
            return
        self.stream = torch.cuda.Stream(device)
        cudart = torch.cuda.cudart()
        for address, size in regions:
            status = cudart.cudaHostRegister(address, size, 0)
            if int(status) != 0:
                log.warning("cudaHostRegister of the %d MiB host pool failed (%s); host->device copies go "
                            "through a pinned bounce buffer (one extra memcpy each)", size >> 20, status)
                self.close()
                return
            self._registered.append(address)

    @property
    def pinned_source(self) -> bool:
        """True when copies read the host pool directly (registered), False when they are bounced."""
        return bool(self._registered)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Event) -> Event:
        """Copy `src` (a host slot) into the start of `dst` once `after` has happened; the copy's event."""
        n = src.numel()
        if not self.cuda:
            dst[:n].copy_(src)
            return None
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            if not self.pinned_source:
                src = self._bounced(src)
            dst[:n].copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        if not self.pinned_source:
            self._bounce.event = event
        return event

    def _bounced(self, src: torch.Tensor) -> torch.Tensor:
        """`src` copied into this worker's pinned buffer, once the previous copy from it has finished."""
        bounce = getattr(self._bounce, "buffer", None)
        if bounce is None:
            bounce = self._bounce.buffer = torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=True)
        previous = getattr(self._bounce, "event", None)
        if previous is not None:
            previous.synchronize()
        bounce[: src.numel()].copy_(src)
        return bounce[: src.numel()]

    def done(self, event: Event) -> bool:
        return event is None or bool(event.query())

    def use(self, event: Event) -> None:
        """Make compute (the current stream) wait for the copy of `event`, without blocking the host."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def released(self) -> Event:
        """The point after which compute no longer reads a slot given back now (None on the CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def close(self) -> None:
        """Unregister the host pool (before the engine unmaps it)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            cudart = torch.cuda.cudart()
            for address in self._registered:
                cudart.cudaHostUnregister(address)
        self._registered.clear()
