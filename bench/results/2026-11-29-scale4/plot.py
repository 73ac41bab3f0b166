"""scale.png of this run: decode ms/token against the cap, one line per system (replayed: the pooled median of
every baseline run's decode steps; own routing and accelerate: their one run; the mla* runs, after bf9e99b,
as lines of their own). Run from this folder."""
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

here = Path(__file__).resolve().parent
steps: dict[tuple[str, str], dict[float, list[float]]] = {}
for path in sorted(here.glob("*.jsonl")):
    if path.name.startswith(("f8", "f16")):  # floor ablations: not the default configuration
        continue
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("ok"):
            key = (row["config"], row["routing"] + " routing" + (", after bf9e99b" if path.name.startswith("mla") else ""))
            steps.setdefault(key, {}).setdefault(row["cap_bytes"] / 2**30, []).extend(row["latencies_ms"])
fig, ax = plt.subplots(figsize=(7, 4.5))
for (config, routing), by_cap in sorted(steps.items()):
    caps = sorted(by_cap)
    ax.plot(caps, [statistics.median(by_cap[c]) for c in caps], marker="o", label=f"{config} ({routing})")
ax.set_xlabel("memory cap (GiB, process + page cache)")
ax.set_ylabel("decode ms/token (median of the decode steps)")
ax.set_yscale("log")
ax.set_xticks([8, 16])
ax.set_title("DeepSeek-V2-Lite size (31 GB) under a memory cgroup, 2 vCPU")
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(here / "scale.png", dpi=120)
