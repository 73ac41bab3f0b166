"""Replay results: per-policy summary, per-request CSV, plots, summary.json and summary.md.

Metrics per policy: TTFT (arrival to first token), TPOT (mean gap between later tokens), end-to-end
latency, per-token latency (end-to-end / output tokens, the MoE-Infinity paper's latency metric),
throughput (output tokens / seconds from the first arrival to the last finish) and SLO attainment
(the share of all requests, failed ones included, whose per-token latency is within `slo_s`).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from .runner import RequestResult


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(results: Sequence[RequestResult], *, slo_s: float = 1.0) -> dict[str, Any]:
    """The summary of one policy's results."""
    done = [r for r in results if not r.error and r.e2e_s is not None]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    e2e = [r.e2e_s for r in done if r.e2e_s is not None]
    per_token = [r.per_token_s for r in done if r.per_token_s is not None]
    tokens = sum(r.output_tokens for r in done)
    span = max((r.arrival_s + r.e2e_s for r in done), default=0.0) - min(
        (r.arrival_s for r in results), default=0.0
    )
    return {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "output_tokens": tokens,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50),
        "tpot_p99_s": _pct(tpot, 99),
        "e2e_p50_s": _pct(e2e, 50),
        "e2e_p99_s": _pct(e2e, 99),
        "per_token_p50_s": _pct(per_token, 50),
        "per_token_p99_s": _pct(per_token, 99),
        "throughput_tok_s": tokens / span if span > 0 else None,
        "slo_s": slo_s,
        "slo_attainment": sum(v <= slo_s for v in per_token) / len(results) if results else None,
    }


def write_csv(path: Path, results: Sequence[RequestResult]) -> None:
    names = [f.name for f in fields(RequestResult)]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for r in results:
            writer.writerow(r.row())


def rate_windows(results: Sequence[RequestResult], window_s: float) -> list[tuple[float, float]]:
    """(request rate, mean per-token latency) over windows of `window_s` seconds of arrivals.

    Windows with the same arrival rate are pooled, so the curve has one point per observed rate.
    """
    buckets: dict[int, list[RequestResult]] = {}
    for r in results:
        buckets.setdefault(int(r.arrival_s // window_s), []).append(r)
    by_rate: dict[float, list[float]] = {}
    for group in buckets.values():
        lat = [r.per_token_s for r in group if r.per_token_s is not None]
        by_rate.setdefault(len(group) / window_s, []).extend(lat)
    return sorted((rate, float(np.mean(lat))) for rate, lat in by_rate.items() if lat)


def write_plots(
    out_dir: Path, by_policy: Mapping[str, Sequence[RequestResult]], *, slo_s: float, window_s: float
) -> list[Path]:
    """latency_cdf.png (per-token latency CDF per policy) and latency_vs_rate.png."""
    # The object-oriented API with an explicit Agg canvas: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    written = []
    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for policy, results in by_policy.items():
        lat = np.sort([r.per_token_s for r in results if r.per_token_s is not None])
        if len(lat):
            ax.step(lat, np.arange(1, len(lat) + 1) / len(results), where="post", label=policy)
    ax.axvline(slo_s, color="grey", linestyle="--", label=f"SLO {slo_s:g} s")
    ax.set_xlabel("per-token latency (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Per-token latency CDF")
    ax.legend()
    fig.tight_layout()
    written.append(out_dir / "latency_cdf.png")
    fig.savefig(written[-1], dpi=120)

    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for policy, results in by_policy.items():
        points = rate_windows(results, window_s)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
    ax.set_xlabel(f"request rate (req/s, {window_s:g} s windows)")
    ax.set_ylabel("mean per-token latency (s)")
    ax.set_title("Latency against request rate")
    ax.legend()
    fig.tight_layout()
    written.append(out_dir / "latency_vs_rate.png")
    fig.savefig(written[-1], dpi=120)
    return written


_MD_COLUMNS = (
    "requests",
    "completed",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "per_token_p50_s",
    "per_token_p99_s",
    "throughput_tok_s",
    "slo_attainment",
)


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def markdown_table(summary: Mapping[str, Mapping[str, Any]]) -> str:
    lines = ["| policy | " + " | ".join(_MD_COLUMNS) + " |", "|---" * (len(_MD_COLUMNS) + 1) + "|"]
    for policy, s in summary.items():
        lines.append(f"| {policy} | " + " | ".join(_cell(s.get(c)) for c in _MD_COLUMNS) + " |")
    return "\n".join(lines)


def write_report(
    out_dir: str | Path,
    by_policy: Mapping[str, Sequence[RequestResult]],
    summary: Mapping[str, Mapping[str, Any]],
    meta: Mapping[str, Any],
    *,
    slo_s: float,
) -> Path:
    """Everything under `out_dir`: requests.csv, the plots, summary.json and summary.md."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "requests.csv", [r for results in by_policy.values() for r in results])
    duration = max((r.arrival_s for rs in by_policy.values() for r in rs), default=0.0)
    write_plots(out, by_policy, slo_s=slo_s, window_s=max(5.0, duration / 12))
    (out / "summary.json").write_text(json.dumps({"meta": dict(meta), "policies": summary}, indent=2) + "\n")
    command = meta.get("command", "")
    text = (
        f"# Trace replay\n\n`{command}`\n\n" + markdown_table(summary) + "\n\n"
        f"Times in seconds. Per-token latency = end-to-end latency / output tokens; SLO attainment = share "
        f"of requests with per-token latency <= {slo_s:g} s.\n"
    )
    (out / "summary.md").write_text(text)
    return out
