"""The rates of this machine that bound a batch job, measured once and cached (MoE-Lightning's HRM levels).

- `drive_bps`: whole experts of the store read in a random order by the runtime's own reader
  (`moeinf.engine.Engine`: O_DIRECT, `io_threads` reads in flight, checksums off), what demand reads and
  prefetches get;
- `memory_bps`: a large tensor copy (read + write counted), what reading resident weights and the KV
  cache is bound by;
- `matmul_flops`: a [rows, H] x [H, H] product in the compute dtype, the dense layers' rate;
- `verify_bps`: the store checksum (`moeinf.engine.checksum`) over a large buffer: the reader checksums
  every blob it reads on its I/O threads, which take CPU from the compute thread when they share a core.

Expert compute comes from the kernel table (`moeinf.batch.kernels`), which knows tokens per expert.
Each rate is measured in the calling process, so under its CPU affinity (`taskset`) and thread count.
The drive is shared with whatever else runs and its rate drifts (1.4-2.4 GB/s on the same store within
hours here), so it is measured again for every plan (a quarter of a second); the others are cached as
JSON under `$MOEINF_CACHE/batch/` per dtype and thread count (delete the file to measure again).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SAMPLE_BYTES = 256 << 20
"""Bytes of experts read to measure the drive (fewer when the store holds fewer)."""


@dataclass(frozen=True)
class Rates:
    drive_bps: float
    memory_bps: float
    matmul_flops: float
    verify_bps: float = math.inf
    """Checksum bytes/s of one thread (inf: reads are not checksummed)."""
    prefill_token_s: float | None = None
    """CPU seconds per prefill token besides the expert products and checksums (attention, norms, routers,
    the LM head, the runtime's bookkeeping), measured on a real prefill pass of the model
    (`moeinf.batch.planner.probe_prefill`); None: estimated from the dense FLOPs."""


def cache_dir() -> Path:
    from moeinf.zoo import cache_root

    return cache_root() / "batch"


def _cached(path: Path, measure: object) -> float:
    if path.is_file():
        return float(json.loads(path.read_text())["value"])
    value = float(measure())  # type: ignore[operator]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"value": value, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
    tmp.replace(path)
    return value


def drive_bandwidth(store_dir: Path, *, sample_bytes: int = SAMPLE_BYTES, seed: int | None = None,
                    io_threads: int = 4, direct_io: bool = True) -> float:
    """Bytes/s of whole experts of `store_dir`, in a random order, through the runtime's reader with
    `io_threads` reads in flight (checksums off: their CPU is `verify_bps`'s). A fresh random sample each
    call unless `seed` is given (a repeated sample would come from the drive's own cache)."""
    from moeinf.engine import Engine
    from moeinf.store.index import StoreIndex

    index = StoreIndex.load(store_dir)
    experts = random.Random(seed).sample(index.experts, len(index.experts))
    sample, total = [], 0
    for e in experts:
        if total >= sample_bytes:
            break
        sample.append(e)
        total += e.size
    slots = max(2 * io_threads, 8)
    with Engine([store_dir / f for f in index.files], max(e.size for e in sample), slots,
                io_threads=io_threads, direct_io=direct_io, verify=False, lock_memory=False) as engine:
        for e in sample:
            engine.add(e.layer, e.expert, e.file, e.offset, e.size, e.checksum)
        start = time.perf_counter()
        for n, e in enumerate(sample):
            engine.submit(e.layer, e.expert, float(len(sample) - n))  # in sample order
            if n >= slots - 1:  # keep the pool full: wait for the oldest read, free its slot
                old = sample[n - slots + 1]
                engine.wait(old.layer, old.expert)
                engine.release(old.layer, old.expert)
        for e in sample[max(len(sample) - slots + 1, 0):]:
            engine.wait(e.layer, e.expert)
        seconds = time.perf_counter() - start
    return total / seconds


def checksum_rate(nbytes: int = 64 << 20) -> float:
    """Bytes/s of the store checksum on one thread (the best of 3)."""
    from moeinf.engine import checksum

    data = bytearray(os.urandom(1 << 20)) * (nbytes >> 20)
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        checksum(data)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def memory_bandwidth(nbytes: int = 256 << 20) -> float:
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def matmul_rate(hidden: int, dtype: str, rows: int = 64) -> float:
    torch_dtype = getattr(torch, dtype)
    x = torch.randn(rows, hidden).to(torch_dtype)
    w = torch.randn(hidden, hidden).to(torch_dtype)
    best = math.inf
    with torch.inference_mode():
        for _ in range(3):
            start = time.perf_counter()
            torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - start)
    return 2 * rows * hidden * hidden / best


def rates(store_dir: Path, hidden: int, dtype: str, directory: Path | None = None, *, io_threads: int = 4,
          direct_io: bool = True, verify: bool = True) -> Rates:
    """This machine's rates for a store, its reader and a compute geometry: the drive measured now, the
    others on first use and cached."""
    directory = directory or cache_dir()
    threads = torch.get_num_threads()
    return Rates(
        drive_bps=drive_bandwidth(store_dir, io_threads=io_threads, direct_io=direct_io),
        memory_bps=_cached(directory / f"memory-t{threads}.json", memory_bandwidth),
        matmul_flops=_cached(directory / f"matmul-H{hidden}-{dtype}-t{threads}.json",
                             lambda: matmul_rate(hidden, dtype)),
        verify_bps=_cached(directory / "checksum.json", checksum_rate) if verify else math.inf,
    )


def as_dict(r: Rates) -> dict[str, float]:
    return asdict(r)
