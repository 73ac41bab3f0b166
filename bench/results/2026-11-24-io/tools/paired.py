"""Paired probe: per round, the raw reader and every engine configuration (shuffled order), each engine's
GB/s next to that round's raw read; medians over rounds.

    python paired.py STORE ROUNDS CONFIG...   # CONFIG: v4c2048 = verify, 4 I/O threads, 2048 KiB chunks;
                                              # nv = no verify; i = verify in the reading thread (needs
                                              # inline-verify-probe.patch and PROBE_INLINE_SLOTS=17)
"""

import json
import random
import resource
import statistics
import sys
from pathlib import Path

from moeinf.bench.io import demand_phase, engine_phase, load_blobs, raw_phase
from moeinf.engine import Engine


def parse(config: str) -> tuple[bool, int, int, int]:
    slots = 17 if config.startswith("i") else 16
    threads, chunk_kib = config.lstrip("nvi").split("c")
    return config[0] in "vi", int(threads), int(chunk_kib) << 10, slots


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    store, rounds, configs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    files, blobs = load_blobs(store)
    size = max(b.size for b in blobs)
    gigabytes = sum(b.size for b in blobs) / 1e9
    rng = random.Random(0)
    engines = {}
    for config in configs:
        verify, threads, chunk, slots = parse(config)
        engine = Engine(files, size, slots, io_threads=threads, chunk_bytes=chunk, verify=verify)
        for b in blobs:
            engine.add(b.layer, b.expert, b.file, b.offset, b.size, b.checksum)
        demand_phase(engine, blobs, rng, 3)
        engines[config] = engine
    rows = []
    for _ in range(rounds):
        row: dict[str, float] = {}
        phases = ["raw", *configs]
        rng.shuffle(phases)
        for phase in phases:
            start = cpu_seconds()
            if phase == "raw":
                row[phase] = raw_phase(files, blobs, 2 << 20)["raw_gbps"]
            else:
                result = engine_phase(engines[phase], rng.sample(blobs, len(blobs)))
                row[phase] = result["engine_gbps"]
                row["vcpu_" + phase] = result["verify_cpu_s_per_gb"]
            row["cpu_" + phase] = (cpu_seconds() - start) / gigabytes
        rows.append(row)
        print(json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
    med = statistics.median
    for c in configs:
        vs_nv = f"ratio/nv4 {med(r[c] / r['nv4c2048'] for r in rows):.3f}" if "nv4c2048" in rows[0] else ""
        print(c, vs_nv,
              f"ratio/raw median {med(r[c] / r['raw'] for r in rows):.3f}",
              f"gbps median {med(r[c] for r in rows):.3f}",
              f"cpu s/GB {med(r['cpu_' + c] for r in rows):.4f}",
              f"verify cpu s/GB {med(r['vcpu_' + c] for r in rows):.4f}")
    print(f"raw gbps median {med(r['raw'] for r in rows):.3f}")

if __name__ == "__main__":
    main()
