"""Replay results: per-run summary, per-request CSV, plots, summary.json and summary.md.

A run is one policy, scheduler (static or continuous batching) and request rate. Metrics per run:
TTFT (arrival to first token), TPOT (mean gap between later tokens), end-to-end latency, per-token
latency (end-to-end / output tokens, the MoE-Infinity paper's latency metric), throughput (output
tokens / seconds from the first arrival to the last finish) and SLO attainment (the share of all
requests, failed ones included, whose per-token latency is within `slo_s`). `comparison` states the
issue's test: at the highest rate where static batching attains 90% of its SLO, TTFT p99 of static
over continuous batching, and both throughputs.
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
        "request_rate": len(results) / arrivals
        if (arrivals := max(r.arrival_s for r in results)) > 0
        else None,
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


def _figure() -> tuple[Any, Any]:
    # The object-oriented API with an explicit Agg canvas: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig: Any, ax: Any, path: Path) -> Path:
    if ax.get_legend_handles_labels()[0]:  # a run without any value of this time draws no line
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _cdf(
    out: Path,
    by_run: Mapping[str, Sequence[RequestResult]],
    field: str,
    title: str,
    slo_s: float | None = None,
) -> Path:
    """CDF of one per-request time over all requests of each run (failed requests never reach 1)."""
    fig, ax = _figure()
    for label, results in by_run.items():
        values = np.sort([v for r in results if (v := getattr(r, field)) is not None])
        if len(values):
            ax.step(values, np.arange(1, len(values) + 1) / len(results), where="post", label=label)
    if slo_s is not None:
        ax.axvline(slo_s, color="grey", linestyle="--", label=f"SLO {slo_s:g} s")
    ax.set_xscale("log")
    ax.set_xlabel(f"{title} (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{title} CDF")
    return _save(fig, ax, out)


def _slo_vs_rate(out: Path, summary: Mapping[str, Mapping[str, Any]]) -> Path:
    """SLO attainment against the request rate, one line per policy and scheduler."""
    fig, ax = _figure()
    lines: dict[str, list[tuple[float, float]]] = {}
    for s in summary.values():
        if s.get("request_rate") is not None and s.get("slo_attainment") is not None:
            name = (
                s.get("batching", "")
                if len({v.get("policy") for v in summary.values()}) <= 1
                else (f"{s.get('policy')} {s.get('batching')}")
            )
            lines.setdefault(name, []).append((s["request_rate"], s["slo_attainment"]))
    for name, points in lines.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.axhline(0.9, color="grey", linestyle="--", label="90%")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("SLO attainment")
    ax.set_title("SLO attainment against request rate")
    return _save(fig, ax, out)


def write_plots(
    out_dir: Path,
    by_run: Mapping[str, Sequence[RequestResult]],
    summary: Mapping[str, Mapping[str, Any]],
    *,
    slo_s: float,
) -> list[Path]:
    """ttft_cdf.png, tpot_cdf.png, latency_cdf.png (per-token latency) and slo_vs_rate.png."""
    return [
        _cdf(out_dir / "ttft_cdf.png", by_run, "ttft_s", "Time to first token"),
        _cdf(out_dir / "tpot_cdf.png", by_run, "tpot_s", "Time per output token"),
        _cdf(out_dir / "latency_cdf.png", by_run, "per_token_s", "Per-token latency", slo_s),
        _slo_vs_rate(out_dir / "slo_vs_rate.png", summary),
    ]


def comparison(summary: Mapping[str, Mapping[str, Any]], *, target: float = 0.9) -> list[dict[str, Any]]:
    """Per policy: the highest rate at which static batching attains `target` of its SLO, and there
    the TTFT p99 of static over continuous batching and their throughputs (empty without both)."""
    rows = []
    for policy in dict.fromkeys(s.get("policy") for s in summary.values()):
        runs = {
            (s.get("batching"), s.get("rps_scale")): s for s in summary.values() if s.get("policy") == policy
        }
        ok = [rate for (b, rate), s in runs.items() if b == "static" and (s["slo_attainment"] or 0) >= target]
        if not ok or ("continuous", max(ok)) not in runs:
            continue
        rate = max(ok)
        static, cont = runs[("static", rate)], runs[("continuous", rate)]
        rows.append(
            {
                "policy": policy,
                "rps_scale": rate,
                "static_ttft_p99_s": static["ttft_p99_s"],
                "continuous_ttft_p99_s": cont["ttft_p99_s"],
                "ttft_p99_ratio": static["ttft_p99_s"] / cont["ttft_p99_s"] if cont["ttft_p99_s"] else None,
                "static_throughput_tok_s": static["throughput_tok_s"],
                "continuous_throughput_tok_s": cont["throughput_tok_s"],
            }
        )
    return rows


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
_MD_HEADS = {"requests": "req", "completed": "done", "throughput_tok_s": "tok/s", "slo_attainment": "SLO"}


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def markdown_table(summary: Mapping[str, Mapping[str, Any]]) -> str:
    heads = [_MD_HEADS.get(c, c) for c in _MD_COLUMNS]
    lines = ["| run | req/s | " + " | ".join(heads) + " |", "|---" * (len(_MD_COLUMNS) + 2) + "|"]
    for policy, s in summary.items():
        cells = [_cell(s.get("request_rate")), *(_cell(s.get(c)) for c in _MD_COLUMNS)]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
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
    write_plots(out, by_policy, summary, slo_s=slo_s)
    verdict = comparison(summary)
    (out / "summary.json").write_text(
        json.dumps({"meta": dict(meta), "runs": summary, "static_vs_continuous": verdict}, indent=2) + "\n"
    )
    command = meta.get("command", "")
    text = (
        f"# Trace replay\n\n`{command}`\n\n" + markdown_table(summary) + "\n\n"
        f"Times in seconds. TTFT: arrival to first token; TPOT: mean gap between later tokens; per-token "
        f"latency = end-to-end latency / output tokens; SLO = share of requests (failed ones included) with "
        f"per-token latency <= {slo_s:g} s; tok/s: output tokens over the run's span.\n"
    )
    rows = {f"{s['batching']} {s['max_batch']}" for s in summary.values() if s.get("max_batch")}
    if rows:
        text += f"Rows decoded together (--max-batch): {', '.join(sorted(rows))}.\n"
    for row in verdict:
        text += (
            f"\nAt x{row['rps_scale']:g} ({row['policy']}), the highest rate at which static batching "
            f"attains 90% of its SLO: TTFT p99 static {row['static_ttft_p99_s']:.3g} s vs continuous "
            f"{row['continuous_ttft_p99_s']:.3g} s ({row['ttft_p99_ratio']:.3g}x); throughput "
            f"{row['static_throughput_tok_s']:.4g} vs {row['continuous_throughput_tok_s']:.4g} tok/s.\n"
        )
    (out / "summary.md").write_text(text)
    return out
