"""The table of README.md: this run's gate-weighted rows (`<trace>-seed<S>.jsonl`, beside this file) against
the token-counted rows of ../2026-11-29-fitted3 (its README's first table, 4 places), with the issue's target.

    python compare.py
"""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRACES = {"gptoss20b": "gpt-oss-20b", "gptoss20b-top1": "gpt-oss-20b top-1 proxy"}


def tokens_rows() -> dict[tuple[str, int, str], list[float]]:
    """(trace, seed, "45%") -> [fitted, fitted2, fixed, LRU, LFU, Belady] from fitted3's README."""
    readme = (HERE.parent / "2026-11-29-fitted3" / "README.md").read_text()
    rows: dict[tuple[str, int, str], list[float]] = {}
    trace, seed = "", 0
    for line in readme.split("**Met at")[0].splitlines():
        if not line.startswith("|") or "---" in line or line.startswith("| trace"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        trace = cells[0] or trace
        seed = int(cells[1]) if cells[1] else seed
        if cells[2].endswith("%"):
            rows[(trace, seed, cells[2])] = [float(c) for c in cells[3:9]]
    return rows


def met(value: float, target: float) -> str:
    return "yes" if value >= target else f"no ({(value - target) * 100:+.2f} pt)"


def main() -> None:
    tokens = tokens_rows()
    print("| trace | seed | cache | fitted, weighted | fitted, tokens | fixed, weighted | fixed, tokens | target "
          "| met (weighted) | met (tokens) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for stem, name in TRACES.items():
        for seed in (0, 1, 2):
            lines = (HERE / f"{stem}-seed{seed}.jsonl").read_text().splitlines()
            ratio = {}
            for row in map(json.loads, lines):
                if "policy" in row:
                    ratio[(row["policy"], row["cache_fraction"])] = row["hits"] / (row["hits"] + row["misses"])
            fractions = sorted({f for _, f in ratio})
            for f in fractions:
                pct = f"{round(f * 100)}%"
                fitted, _, fixed, lru, _, belady = tokens[(name, seed, pct)]
                # same split, same baselines: LRU and Belady do not read the weights
                assert abs(ratio[("lru", f)] - lru) < 6e-5 and abs(ratio[("oracle", f)] - belady) < 6e-5
                base = max(ratio[("lru", f)], ratio[("lfu", f)])
                target = max(base + min(0.03, (ratio[("oracle", f)] - base) / 3), fixed - 0.01)
                weighted = ratio[("fitted", f)]
                first = f == fractions[0]
                print(f"| {name if seed == 0 and first else ''} | {seed if first else ''} | {pct} | {weighted:.4f} "
                      f"| {fitted:.4f} | {ratio[('activation-aware', f)]:.4f} | {fixed:.4f} | {target:.4f} "
                      f"| {met(weighted, target)} | {met(fitted, target)} |")


if __name__ == "__main__":
    main()
