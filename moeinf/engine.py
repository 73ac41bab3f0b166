"""The expert I/O engine: the host-DRAM tier between the expert store and compute.

A pool of fixed-size, 4 KiB-aligned, page-locked slots allocated once; a priority queue of reads; I/O
threads that read each blob chunk by chunk with O_DIRECT, checksum each chunk as it lands and re-check the
queue between chunks, so a demand fetch at `MAX_PRIORITY` jumps every queued prefetch and waits behind at
most one chunk per thread. The engine knows files, offsets, sizes, checksums, integer keys and priorities,
nothing of models. This module is the only one that imports the C++ extension `moeinf._engine`.

    engine = Engine.from_store(store, num_slots=64)
    engine.submit(3, 17, priority=0.4)            # prefetch
    blob = engine.wait(2, 5)                      # demand: submits at MAX_PRIORITY, GIL released
    tensors = store.tensors(2, 5, blob)           # zero-copy views, valid until release
    engine.release(2, 5)

Contract (docs/internals.md, "Engine"): a key in flight or resident is never read twice; a resident key
keeps its slot until `release`; when no slot is free reads wait (back-pressure) and `wait(timeout=...)`
raises `TimeoutError`; a failed read raises `EngineError` naming the file and (layer, expert) in that
key's waiters only, and a later `submit` of the key retries it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

from . import _engine

log = logging.getLogger(__name__)


class Blobs(Protocol):
    """Files of expert blobs and where each blob lies in them: what `Engine.from_store` reads (a
    `moeinf.store.Store`, which sits above the engine)."""

    max_blob_size: int
    index: Any
    """`files` (one per path) and `experts` (entries with layer, expert, file, offset, size, checksum)."""

    def path(self, file: int) -> Any: ...

Key = tuple[int, int]

EngineError = _engine.EngineError
"""A read failed (missing file, I/O error, short read, checksum mismatch); a RuntimeError subclass."""
MAX_PRIORITY: float = _engine.MAX_PRIORITY
"""The priority of demand fetches, above every prefetch priority."""
ALIGNMENT: int = _engine.ALIGNMENT
"""Blob offsets, blob sizes and chunk sizes are multiples of this (O_DIRECT)."""
DEFAULT_CHUNK_BYTES = 2 << 20
DEFAULT_IO_THREADS = 4
"""Reads in flight: enough to keep an NVMe queue busy with 2 MiB requests (bench/README.md, "Engine I/O")."""

STATES = ("idle", "queued", "reading", "ready", "failed")


class Engine:
    """Reads registered blobs into a slot pool by priority; see the module docstring for the contract.

    `files` are the blob files (a blob names one by index); `slot_bytes` must hold the largest blob
    (`Store.max_blob_size`); `num_slots` slots are allocated at construction and never more. `chunk_bytes`
    bounds how long a demand fetch waits behind a read in progress; `io_threads` is the number of reads
    in flight. With `direct_io` the files are read with O_DIRECT; a file system that refuses it (tmpfs) is
    read through the page cache and `stats()["direct_io"]` is False. `verify` checksums every read (in the
    reading thread, chunk by chunk). `lock_memory` page-locks the pool (mlock) so it is never swapped and
    a GPU driver can copy from it asynchronously; where the memlock limit refuses, the pool stays pageable,
    `stats()["pool_locked"]` is False and a warning says how to raise the limit. `paused=True` starts with
    the I/O threads idle until `resume()`, which makes the queue order observable (tests, staging).
    """

    MAX_PRIORITY: ClassVar[float] = MAX_PRIORITY

    def __init__(self, files: Sequence[str | os.PathLike[str]], slot_bytes: int, num_slots: int, *,
                 io_threads: int = DEFAULT_IO_THREADS, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 direct_io: bool = True, verify: bool = True, lock_memory: bool = True,
                 paused: bool = False) -> None:
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be > 0 (the largest blob size), got {slot_bytes}")
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        if chunk_bytes < ALIGNMENT or chunk_bytes % ALIGNMENT:
            raise ValueError(f"chunk_bytes must be a multiple of {ALIGNMENT} (e.g. 2 MiB), got {chunk_bytes}")
        self.files = [os.fspath(f) for f in files]
        self._engine = _engine.Engine(self.files, slot_bytes, num_slots, io_threads, chunk_bytes, direct_io,
                                      verify, lock_memory, paused)
        stats = self._engine.stats()
        if direct_io and not stats["direct_io"]:
            log.warning("O_DIRECT is refused by the file system of %s; reading through the page cache "
                        "(pass direct_io=False to ask for this explicitly)", ", ".join(self.files))
        if lock_memory and not stats["pool_locked"]:
            pool = sum(size for _, size in self._engine.regions())
            log.warning("the %d MiB slot pool could not be page-locked (mlock): the memlock limit is %s; it "
                        "stays pageable (it may be swapped, and host->GPU copies from it are synchronous). "
                        "Raise the limit (`ulimit -l unlimited`, or memlock in /etc/security/limits.conf) "
                        "or pass lock_memory=False to silence this", pool >> 20, _memlock_limit())

    @classmethod
    def from_store(cls, store: Blobs, num_slots: int, **options: Any) -> Engine:
        """An engine over every expert blob of `store` (a `moeinf.store.Store`), all registered."""
        engine = cls([store.path(i) for i in range(len(store.index.files))], store.max_blob_size, num_slots,
                     **options)
        for entry in store.index.experts:
            engine.add(entry.layer, entry.expert, entry.file, entry.offset, entry.size, entry.checksum,
                       entry.raw_size)
        return engine

    def add(self, layer: int, expert: int, file: int, offset: int, size: int, checksum: int,
            raw_size: int = 0) -> None:
        """Register the blob of (layer, expert): `size` bytes at `offset` of `files[file]`; with `raw_size`
        > 0 they are coded (`moeinf/store/codec.py`) and decode, in the slot, to `raw_size` bytes."""
        self._engine.add(layer, expert, file, offset, size, checksum, raw_size)

    def submit(self, layer: int, expert: int, priority: float) -> None:
        """Queue a read, or move a queued one to `priority` (higher = sooner). No-op when resident;
        a read in progress is not restarted, it only takes the new priority."""
        self._engine.submit(layer, expert, priority)

    def cancel(self, layer: int, expert: int) -> bool:
        """Drop a queued read (a paused, partly read one gives its slot back) or forget a failed one. False
        when the key is idle, being read or resident, or some thread is waiting for it."""
        return self._engine.cancel(layer, expert)

    def wait(self, layer: int, expert: int, timeout: float | None = None) -> memoryview:
        """The blob of (layer, expert) once resident, as a writable zero-copy memoryview of its slot
        (`torch.frombuffer`, `Store.tensors`); valid until `release`. A key neither queued nor in flight is
        submitted at `MAX_PRIORITY`. Blocks with the GIL released; Ctrl-C interrupts it.

        Raises `TimeoutError` after `timeout` seconds and `EngineError` if the read failed."""
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
        return memoryview(self._engine.wait(layer, expert, -1.0 if timeout is None else float(timeout)))

    def release(self, layer: int, expert: int) -> None:
        """Evict: the slot returns to the pool (views of it become invalid). A queued or in-flight read of
        the key is dropped unless someone waits for it; releasing an idle key does nothing."""
        self._engine.release(layer, expert)

    def is_resident(self, layer: int, expert: int) -> bool:
        return self._engine.is_resident(layer, expert)

    def resident(self) -> list[Key]:
        """Resident keys, sorted."""
        return self._engine.resident()

    def queued(self) -> list[Key]:
        """Queued keys in the order they will be read (highest priority first)."""
        return self._engine.queued()

    def completed(self) -> list[Key]:
        """Keys in the order their reads completed since `reset_stats` (the last 4096)."""
        return self._engine.completed()

    def state(self, layer: int, expert: int) -> str:
        """One of `STATES`."""
        return self._engine.state(layer, expert)

    def free_slots(self) -> int:
        return self._engine.free_slots()

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of each region of the slot pool, e.g. to register it with a GPU driver."""
        return self._engine.regions()

    def pause(self) -> None:
        """Stop starting reads; a read in progress stops after its current chunk and stays queued."""
        self._engine.pause()

    def resume(self) -> None:
        self._engine.resume()

    def stats(self) -> dict[str, Any]:
        """Counters since `reset_stats`: bytes_read, fetches_demand / fetches_prefetch, hits (wait on a
        resident key), waits_blocked, failures, cancels, preemptions; bytes_verified and verify_cpu_s
        (CPU seconds the checksums took, thread clocks); submit->ready latency percentiles
        demand_p50_ms / demand_p99_ms / prefetch_p50_ms / prefetch_p99_ms and queue_wait_p50_ms /
        queue_wait_p99_ms (NaN before the first sample); direct_io; pool_locked; slots_total / slots_used /
        slots_free; queued; numa_nodes; and the configuration (slot_bytes, chunk_bytes, io_threads, verify,
        lock_memory)."""
        return self._engine.stats()

    def reset_stats(self) -> None:
        self._engine.reset_stats()

    def close(self) -> None:
        """Stop and join the I/O threads; waiters get RuntimeError. Idempotent."""
        self._engine.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _memlock_limit() -> str:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft >> 10} KiB"


def raw_read(path: str | os.PathLike[str], offset: int, size: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
             direct: bool = True, buffer_bytes: int = 0) -> dict[str, Any]:
    """Read [offset, offset + size) of `path` sequentially in `chunk_bytes` pieces, one request at a time,
    in C++ with the GIL released: the dd-equivalent baseline of `moeinf bench io`. The pieces land in one
    chunk-sized buffer or, with `buffer_bytes`, one after the other around a buffer that large (a reader
    that keeps what it reads). Returns bytes, seconds, direct_io."""
    return _engine.raw_read(os.fspath(path), [(offset, size)], chunk_bytes, direct, buffer_bytes)


def raw_read_ranges(path: str | os.PathLike[str], ranges: Sequence[tuple[int, int]], *,
                    chunk_bytes: int = DEFAULT_CHUNK_BYTES, direct: bool = True) -> dict[str, Any]:
    """`raw_read` of several (offset, size) ranges in the given order (e.g. blobs in a random order)."""
    return _engine.raw_read(os.fspath(path), list(ranges), chunk_bytes, direct)


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The store's fletcher64w checksum, in C++ (`moeinf.store.checksum` computes the same in numpy)."""
    return _engine.checksum(data)
