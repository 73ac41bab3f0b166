"""I/O benchmark: the expert engine against raw sequential O_DIRECT reads of the same store.

In one run, per repeat: (1) `raw_read` reads every blob file sequentially in chunk-sized O_DIRECT reads, one
request at a time (the dd-equivalent baseline, in C++): raw_gbps; (2) the engine fetches every expert once
in a random order (all submitted as prefetches, consumed and released in that order): engine_gbps; (3) the
same raw reader reads the blobs in that random order: raw_random_gbps, which separates the cost of the
access order from the engine's own; (3b) the raw reader of (1) with its reads landing one after the other
around a buffer as large as the engine's pool instead of in one chunk buffer: raw_pool_gbps, a second
reference for transparency (what a reader that keeps its bytes attains: on a virtio disk it can reach well
under raw_gbps; the target is judged against raw_gbps); (4) demand fetches of single experts on an idle
engine; (5) demand fetches issued while a long prefetch queue drains (preemption). Everything bypasses the
page cache (O_DIRECT), so no cache eviction is needed. Prints one JSON object; figures are medians over
repeats. Targets: ratio >= 0.90, demand_p50_ms <= 1.2 x demand_p50_ideal_ms (one expert's bytes at the raw
bandwidth), preempt_p50_ms <= 2 x demand_p50_ideal_ms.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeinf.bench.common import machine
from moeinf.config import OffloadConfig, parse_size
from moeinf.engine import Engine, EngineError, raw_read, raw_read_ranges

log = logging.getLogger(__name__)

TARGET_RATIO = 0.90
TARGET_DEMAND = 1.2
TARGET_PREEMPT = 2.0


@dataclass(frozen=True)
class Blob:
    layer: int
    expert: int
    file: int
    offset: int
    size: int
    checksum: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store_dir", metavar="STORE_DIR",
                        help="an expert store (moeinf pack, bench/make_store.py)")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--repeats", type=int, default=3, help="measured repeats; figures are medians (3)")
    parser.add_argument("--slots", type=int, default=16, help="engine pool slots (16)")
    chunk = int(parse_size(OffloadConfig.chunk_size, field="chunk_size"))
    parser.add_argument("--chunk-bytes", type=int, default=chunk,
                        help=f"read chunk ({chunk}, the runtime's chunk_size)")
    parser.add_argument("--io-threads", type=int, default=OffloadConfig.io_threads,
                        help=f"engine I/O threads ({OffloadConfig.io_threads}, the runtime's io_threads)")
    parser.add_argument("--no-verify", action="store_true",
                        help="do not checksum engine reads (the runtime verifies by default)")
    parser.add_argument("--samples", type=int, default=20, help="demand fetches per repeat and phase (20)")
    parser.add_argument("--seed", type=int, default=0)


def load_blobs(store_dir: Path) -> tuple[list[Path], list[Blob]]:
    """The blob files and blobs of a store: through `moeinf.store.Store` when present, else the index."""
    try:
        from moeinf.store import Store
    except ImportError:
        index = json.loads((store_dir / "moeinf-store.json").read_text())
        files = [store_dir / name for name in index["files"]]
        blobs = [Blob(e["layer"], e["expert"], e["file"], e["offset"], e["size"], e["checksum"])
                 for e in index["experts"]]
        return files, blobs
    store = Store(store_dir)
    files = [store.path(i) for i in range(len(store.index.files))]
    return files, [Blob(e.layer, e.expert, e.file, e.offset, e.size, e.checksum) for e in store.index.experts]


def read_extents(files: list[Path], blobs: list[Blob], chunk_bytes: int,
                 buffer_bytes: int = 0) -> tuple[int, float, bool]:
    """Sequential O_DIRECT reads of each file's blob extent (into one chunk buffer, or around a buffer of
    `buffer_bytes`): bytes, seconds, whether every read was O_DIRECT."""
    total_bytes, seconds, direct = 0, 0.0, True
    for index, path in enumerate(files):
        extent = [b for b in blobs if b.file == index]
        if not extent:
            continue
        start = min(b.offset for b in extent)
        end = max(b.offset + b.size for b in extent)
        result = raw_read(path, start, end - start, chunk_bytes=chunk_bytes, buffer_bytes=buffer_bytes)
        total_bytes += result["bytes"]
        seconds += result["seconds"]
        direct = direct and result["direct_io"]
    return total_bytes, seconds, direct


def raw_phase(files: list[Path], blobs: list[Blob], chunk_bytes: int) -> dict[str, Any]:
    """The baseline: sequential O_DIRECT reads of each file's blob extent into one chunk buffer."""
    total_bytes, seconds, direct = read_extents(files, blobs, chunk_bytes)
    return {"raw_gbps": total_bytes / seconds / 1e9, "raw_bytes": total_bytes, "raw_direct_io": direct}


def raw_pool_phase(files: list[Path], blobs: list[Blob], chunk_bytes: int, pool_bytes: int) -> dict[str, Any]:
    """The same reads landing one after the other around a buffer of the engine pool's size."""
    total_bytes, seconds, _ = read_extents(files, blobs, chunk_bytes, buffer_bytes=pool_bytes)
    return {"raw_pool_gbps": total_bytes / seconds / 1e9}


def raw_random_phase(files: list[Path], order: list[Blob], chunk_bytes: int) -> dict[str, Any]:
    """The raw reader over the blobs in `order` (the engine phase's order)."""
    seconds = 0.0
    for index, path in enumerate(files):
        ranges = [(b.offset, b.size) for b in order if b.file == index]
        if ranges:
            seconds += raw_read_ranges(path, ranges, chunk_bytes=chunk_bytes)["seconds"]
    return {"raw_random_gbps": sum(b.size for b in order) / seconds / 1e9}


def engine_phase(engine: Engine, order: list[Blob]) -> dict[str, Any]:
    """Every expert once, in `order`: submitted as prefetches, consumed and released in that order.
    CPU figures are per GB: the whole process over the phase (every thread, per GB read) and the checksums
    alone (the engine's thread clocks, per GB verified); unlike GB/s they hardly depend on the load."""
    engine.reset_stats()
    cpu_start = time.process_time()
    start = time.perf_counter()
    for rank, blob in enumerate(order):
        engine.submit(blob.layer, blob.expert, 1.0 - rank / len(order))
    for blob in order:
        engine.wait(blob.layer, blob.expert)
        engine.release(blob.layer, blob.expert)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    stats = engine.stats()
    gigabytes = sum(b.size for b in order) / 1e9
    verified_gb = stats["bytes_verified"] / 1e9
    return {"engine_gbps": gigabytes / seconds,
            "engine_cpu_s_per_gb": cpu_seconds / gigabytes,
            "verify_cpu_s_per_gb": stats["verify_cpu_s"] / verified_gb if verified_gb else float("nan"),
            "prefetch_p50_ms": stats["prefetch_p50_ms"], "queue_wait_p50_ms": stats["queue_wait_p50_ms"],
            "engine_direct_io": stats["direct_io"]}


def demand_phase(engine: Engine, blobs: list[Blob], rng: random.Random, samples: int) -> dict[str, Any]:
    """Single demand fetches on an idle engine (submit -> ready as measured by the engine)."""
    engine.reset_stats()
    for blob in rng.sample(blobs, min(samples, len(blobs))):
        engine.wait(blob.layer, blob.expert)
        engine.release(blob.layer, blob.expert)
    stats = engine.stats()
    return {"demand_p50_ms": stats["demand_p50_ms"], "demand_p99_ms": stats["demand_p99_ms"]}


def preempt_phase(engine: Engine, blobs: list[Blob], rng: random.Random, samples: int) -> dict[str, Any]:
    """Demand fetches issued while a long prefetch queue drains: each must jump the queue and wait behind
    at most one chunk of the read in progress. Prefetches use half of the experts, demands the other half."""
    shuffled = rng.sample(blobs, len(blobs))
    prefetch, demand = shuffled[: len(shuffled) // 2], shuffled[len(shuffled) // 2 :]
    engine.reset_stats()
    for rank, blob in enumerate(prefetch):
        engine.submit(blob.layer, blob.expert, 1.0 - rank / len(prefetch))

    def consume() -> None:
        for blob in prefetch:
            engine.wait(blob.layer, blob.expert)
            engine.release(blob.layer, blob.expert)

    consumer = threading.Thread(target=consume, name="bench-io-consumer")
    consumer.start()
    issued = 0
    for blob in demand[:samples]:
        time.sleep(rng.uniform(0.002, 0.02))  # land at a random point of a prefetch read
        if engine.stats()["queued"] == 0:
            break  # the queue drained: later fetches would not be preemptions
        engine.wait(blob.layer, blob.expert)
        engine.release(blob.layer, blob.expert)
        issued += 1
    consumer.join()
    stats = engine.stats()
    return {"preempt_p50_ms": stats["demand_p50_ms"], "preempt_p99_ms": stats["demand_p99_ms"],
            "preempt_samples": issued, "preemptions": stats["preemptions"]}


def device_of(path: Path) -> dict[str, Any]:
    """The block device holding `path` and whether it is rotational, from sysfs (best effort)."""
    st = os.stat(path)
    sys_dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if not sys_dev.exists():
        return {"device": f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"}
    real = sys_dev.resolve()
    queue = real / "queue" if (real / "queue").exists() else real.parent / "queue"
    rotational = (queue / "rotational").read_text().strip() if (queue / "rotational").exists() else None
    return {"device": real.name, "rotational": rotational == "1" if rotational is not None else None}


def pool_huge_fraction(engine: Engine) -> float | None:
    """The share of the engine's pool backed by transparent huge pages (/proc/self/smaps), None where that
    file is absent. A read into 4 KiB pages costs the drive one DMA segment per page: on the virtio disk
    measured here such reads ran at about half the speed of reads into huge pages, so a pool the kernel
    could not back with huge pages (fragmented or scarce memory) explains a low ratio."""
    smaps = Path("/proc/self/smaps")
    if not smaps.is_file():
        return None
    regions = engine.regions()
    pool_bytes = sum(size for _, size in regions)
    huge_kib, inside = 0, False
    for line in smaps.read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = any(start < address + size and address < end for address, size in regions)
        elif inside and head == "AnonHugePages:":
            huge_kib += int(line.split()[1])
    return min(1.0, huge_kib * 1024 / pool_bytes) if pool_bytes else None


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    store_dir = Path(args.store_dir)
    files, blobs = load_blobs(store_dir)
    if not blobs:
        raise ValueError(f"{store_dir} holds no experts")
    rng = random.Random(args.seed)
    expert_bytes = max(b.size for b in blobs)
    engine = Engine(files, expert_bytes, args.slots, io_threads=args.io_threads, chunk_bytes=args.chunk_bytes,
                    verify=not args.no_verify)
    with engine:
        for b in blobs:
            engine.add(b.layer, b.expert, b.file, b.offset, b.size, b.checksum)
        demand_phase(engine, blobs, rng, 3)  # warm-up: threads, file handles, pool pages
        raw_read(files[0], blobs[0].offset, blobs[0].size, chunk_bytes=args.chunk_bytes)
        runs = []
        for _ in range(args.repeats):
            run: dict[str, Any] = {}
            run.update(raw_phase(files, blobs, args.chunk_bytes))
            order = rng.sample(blobs, len(blobs))
            run.update(engine_phase(engine, order))
            run.update(raw_random_phase(files, order, args.chunk_bytes))
            run.update(raw_pool_phase(files, blobs, args.chunk_bytes, args.slots * expert_bytes))
            run["paired_ratio"] = run["engine_gbps"] / run["raw_gbps"]
            run.update(demand_phase(engine, blobs, rng, args.samples))
            run.update(preempt_phase(engine, blobs, rng, args.samples))
            runs.append(run)
        numa_nodes = engine.stats()["numa_nodes"]
        huge_fraction = pool_huge_fraction(engine)
    figures = {key: median([r[key] for r in runs]) for key in runs[0] if isinstance(runs[0][key], float)}
    ideal_ms = expert_bytes / (figures["raw_gbps"] * 1e9) * 1e3
    result: dict[str, Any] = {
        "bench": "io", "store": str(store_dir), "store_bytes": sum(b.size for b in blobs),
        "experts": len(blobs), "expert_bytes": expert_bytes, **figures,
        "ratio": figures["engine_gbps"] / figures["raw_gbps"],
        "ratio_vs_raw_random": figures["engine_gbps"] / figures["raw_random_gbps"],
        "ratio_vs_raw_pool": figures["engine_gbps"] / figures["raw_pool_gbps"],
        # The median of each repeat's engine / raw (measured seconds apart): steadier than the ratio of
        # medians when the drive's speed drifts during the run (a shared virtual disk).
        "paired_ratio": figures["paired_ratio"],
        "demand_p50_ideal_ms": ideal_ms,
        "demand_over_ideal": figures["demand_p50_ms"] / ideal_ms,
        "preempt_over_ideal": figures["preempt_p50_ms"] / ideal_ms,
        "preempt_samples": sum(r["preempt_samples"] for r in runs),
        "preemptions": sum(r["preemptions"] for r in runs),
        "direct_io": all(r["engine_direct_io"] and r["raw_direct_io"] for r in runs),
        "pool_huge_fraction": huge_fraction,
        "config": {"repeats": args.repeats, "slots": args.slots, "chunk_bytes": args.chunk_bytes,
                   "io_threads": args.io_threads, "verify": not args.no_verify, "samples": args.samples,
                   "seed": args.seed},
        "machine": {**machine(), **device_of(files[0]), "numa_nodes": numa_nodes},
        "runs": runs,
    }
    result["meets_targets"] = (result["ratio"] >= TARGET_RATIO
                               and result["demand_over_ideal"] <= TARGET_DEMAND
                               and result["preempt_over_ideal"] <= TARGET_PREEMPT)
    return result


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.samples < 1:
        print("moeinf bench io: error: --repeats and --samples must be >= 1", file=sys.stderr)
        return 2
    if not (Path(args.store_dir) / "moeinf-store.json").is_file():
        print(f"moeinf bench io: error: {args.store_dir} is not an expert store (no moeinf-store.json); "
              "make one with `moeinf pack` or bench/make_store.py", file=sys.stderr)
        return 1
    try:
        result = measure(args)
    except EngineError as exc:
        print(f"moeinf bench io: error: {exc}", file=sys.stderr)
        return 1
    if not args.json:
        print(f"store {result['store']}: {result['experts']} experts x "
              f"{result['expert_bytes'] / 2**20:.1f} MiB")
        print(f"  raw O_DIRECT   {result['raw_gbps']:.3f} GB/s")
        print(f"  raw, random    {result['raw_random_gbps']:.3f} GB/s  (the engine's order)")
        print(f"  raw, pool-size {result['raw_pool_gbps']:.3f} GB/s  (reads landing around a buffer as large "
              "as the engine's pool; for reference only)")
        print(f"  engine         {result['engine_gbps']:.3f} GB/s  (ratio {result['ratio']:.3f}, "
              f"target >= {TARGET_RATIO}; {result['ratio_vs_raw_random']:.3f} of raw random)")
        print(f"  engine CPU     {result['engine_cpu_s_per_gb']:.4f} s per GB read, checksums "
              f"{result['verify_cpu_s_per_gb']:.4f} s per GB verified")
        print(f"  demand p50     {result['demand_p50_ms']:.2f} ms  "
              f"(ideal {result['demand_p50_ideal_ms']:.2f} ms, x{result['demand_over_ideal']:.2f}, "
              f"target <= {TARGET_DEMAND})")
        print(f"  preempt p50    {result['preempt_p50_ms']:.2f} ms  (x{result['preempt_over_ideal']:.2f}, "
              f"target <= {TARGET_PREEMPT})")
    print(json.dumps(result))
    return 0
