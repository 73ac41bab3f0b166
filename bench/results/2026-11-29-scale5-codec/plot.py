"""ms/token against the memory cap, one line per system (replayed routing), and the own-routing points at
8 GiB; run from this folder: python plot.py -> scale.png."""
import json
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

here = Path(__file__).parent
rows = [json.loads(line) for name in ("e8r", "e16r", "c8r", "c16r", "e8own", "c8own", "acc8")
        for line in (here / f"{name}.jsonl").read_text().splitlines() if line.strip()]
rows = [dict(r, store="coded" if r.get("store", "").endswith(".coded") else "exact") for r in rows]
fig, ax = plt.subplots(figsize=(7, 4.5))
for store in ("exact", "coded"):
    for config in ("default", "on-demand-lru"):
        pts = sorted((r["cap_bytes"] / 2**30, r["ms_per_token"]) for r in rows
                     if r["store"] == store and r["config"] == config and r["routing"] == "replayed")
        ax.plot(*zip(*pts), marker="o", linestyle="-" if store == "exact" else "--",
                label=f"moeinf {config}, {store} store, replayed routing")
for r in rows:
    if r["routing"] == "own" and r["config"] == "default":
        ax.scatter(r["cap_bytes"] / 2**30, r["ms_per_token"], marker="x", s=60,
                   label=f"moeinf default, {r['store']} store, own routing")
acc = [r for r in rows if r["config"] == "accelerate"]
ax.scatter([r["cap_bytes"] / 2**30 for r in acc], [r["ms_per_token"] for r in acc], marker="s",
           label="HF + accelerate disk offload, own routing")
ax.set_yscale("log")
ax.set_xlabel("memory cap (GiB; process + page cache)")
ax.set_ylabel("decode ms/token (median)")
ax.set_xticks([8, 16])
ax.set_title("DeepSeek-V2-Lite size (31 GB bf16) on a 2-vCPU Xeon")
ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(here / "scale.png", dpi=110)
