"""The rates of this machine that bound a batch job, measured once and cached (MoE-Lightning's HRM levels).

- `drive_bps`: O_DIRECT reads of whole experts of the store in a random order (the engine's pattern);
- `memory_bps`: a large tensor copy (read + write counted), what reading resident weights and the KV
  cache is bound by;
- `matmul_flops`: a [rows, H] x [H, H] product in the compute dtype, the dense layers' rate.

Expert compute comes from the kernel table (`moeinf.batch.kernels`), which knows tokens per expert.
Each rate is cached as JSON under `$MOEINF_CACHE/batch/` (drive rates per store file system, the others
per dtype and thread count); delete the file to measure again.
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


def drive_bandwidth(store_dir: Path, *, sample_bytes: int = SAMPLE_BYTES, seed: int = 0) -> float:
    """Bytes/s of O_DIRECT reads of whole experts of `store_dir` in a random order."""
    from moeinf.engine import raw_read_ranges
    from moeinf.store.index import StoreIndex

    index = StoreIndex.load(store_dir)
    experts = random.Random(seed).sample(index.experts, len(index.experts))
    total, seconds = 0, 0.0
    by_file: dict[int, list[tuple[int, int]]] = {}
    for e in experts:
        if total >= sample_bytes:
            break
        by_file.setdefault(e.file, []).append((e.offset, e.size))
        total += e.size
    for file, ranges in by_file.items():
        seconds += raw_read_ranges(store_dir / index.files[file], ranges)["seconds"]
    return total / seconds


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


def rates(store_dir: Path, hidden: int, dtype: str, directory: Path | None = None) -> Rates:
    """This machine's rates for a store and a compute geometry, measured on first use and cached."""
    from moeinf.store.index import StoreIndex

    directory = directory or cache_dir()
    device = os.stat(store_dir).st_dev
    threads = torch.get_num_threads()
    if sum(e.size for e in StoreIndex.load(store_dir).experts) >= SAMPLE_BYTES:
        drive = _cached(directory / f"drive-dev{device}.json", lambda: drive_bandwidth(store_dir))
    else:  # a small store is read from the drive's cache as much as from the drive: measured, never kept
        drive = drive_bandwidth(store_dir)
    return Rates(
        drive_bps=drive,
        memory_bps=_cached(directory / f"memory-t{threads}.json", memory_bandwidth),
        matmul_flops=_cached(directory / f"matmul-H{hidden}-{dtype}-t{threads}.json",
                             lambda: matmul_rate(hidden, dtype)),
    )


def as_dict(r: Rates) -> dict[str, float]:
    return asdict(r)
