"""Issue 40's target per (trace, seed, cache size) from `moeinf bench cache --out` files: fitted >= best(LRU,
LFU) + min(3 points, a third of the gap from that best to Belady), and >= the fixed score - 1 point.

    python summary.py FILE.jsonl [...]   # `moeinf bench cache --out` files
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def cells(path: Path):
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    head = rows[0]
    by_capacity: dict[int, dict[str, dict]] = defaultdict(dict)
    for row in rows:
        by_capacity[row["capacity"]][row["policy"]] = row
    name = Path(head["workload"]).name.split(".")[0] + (" top-1" if head.get("top1_proxy") else "")
    for capacity, policies in sorted(by_capacity.items()):
        n = policies["lru"]["hits"] + policies["lru"]["misses"]
        ratio = {p: r["hits"] / n for p, r in policies.items()}
        best = max(ratio["lru"], ratio["lfu"])
        target = max(best + min(0.03, (ratio["oracle"] - best) / 3), ratio["activation-aware"] - 0.01)
        yield {"trace": name, "seed": head["seed"], "fraction": policies["lru"]["cache_fraction"],
               "fitted": ratio["fitted"], "target": target, "met": ratio["fitted"] >= target,
               "short_hits": max(0, round(target * n - policies["fitted"]["hits"])),
               "fixed": ratio["activation-aware"], "best": best, "belady": ratio["oracle"],
               "seconds": head["seconds"], "fit_seconds": head["fit_seconds"],
               "first_use": [r.get("first_use", 0.0) for r in head["fit"]["rows"]]}


def main() -> None:
    out = [c for f in sys.argv[1:] for c in cells(Path(f))]
    print("| trace | seed | cache | fitted | target | fitted - target (pt) | met |")
    print("|---|---|---|---|---|---|---|")
    for c in out:
        print(f"| {c['trace']} | {c['seed']} | {c['fraction']:.0%} | {c['fitted']:.5f} | {c['target']:.5f} | "
              f"{100 * (c['fitted'] - c['target']):+.3f} | {'yes' if c['met'] else 'no'} |")
    print(f"\nmet {sum(c['met'] for c in out)} of {len(out)}")
    seen = {}
    for c in out:
        seen[(c["trace"], c["seed"])] = (c["seconds"], c["fit_seconds"], c["first_use"])
    for key, (s, f, fu) in seen.items():
        print(key, f"sweep {s} s, fit {f} s, first_use per size {fu}")


if __name__ == "__main__":
    main()
