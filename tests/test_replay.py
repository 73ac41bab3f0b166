"""Trace replay: trace parsing and scaling, exact-length prompts, and the command end to end."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from test_serve_helpers import load_test_tokenizer, tiny_chat_dir  # noqa: F401

from moeinf.cli import main
from moeinf.replay.report import summarize
from moeinf.replay.runner import RequestResult
from moeinf.replay.workload import (
    DEFAULT_TRACE,
    PromptPool,
    TraceRow,
    build_workload,
    load_prompts,
    load_trace,
    scale_rows,
)


def test_load_trace_window_of_the_real_trace() -> None:
    rows = load_trace(DEFAULT_TRACE, duration_s=10.0)
    with open(DEFAULT_TRACE, newline="") as f:
        first = next(csv.DictReader(f))
    assert rows[0] == TraceRow(0.0, int(first["ContextTokens"]), int(first["GeneratedTokens"]))
    assert all(0 <= a.arrival_s <= b.arrival_s < 10.0 for a, b in zip(rows, rows[1:], strict=False))
    later = load_trace(DEFAULT_TRACE, start_s=5.0, duration_s=5.0)
    assert [r.context_tokens for r in later] == [r.context_tokens for r in rows if r.arrival_s >= 5.0]
    assert later[0].arrival_s == pytest.approx(
        rows[[r.arrival_s >= 5 for r in rows].index(True)].arrival_s - 5
    )


def test_bad_trace_names_the_columns(tmp_path: Path) -> None:
    bad = tmp_path / "t.csv"
    bad.write_text("time,ctx\n1,2\n")
    with pytest.raises(ValueError, match="ContextTokens"):
        load_trace(bad)


def test_scaling() -> None:
    rows = [TraceRow(0.0, 100, 40), TraceRow(4.0, 10, 3)]
    out = scale_rows(rows, rps_scale=2.0, length_scale=0.5, max_new_tokens_cap=8)
    assert out == [TraceRow(0.0, 50, 8), TraceRow(2.0, 5, 2)]


def test_prompts_have_the_trace_lengths(tiny_chat_dir) -> None:  # noqa: F811
    tok = load_test_tokenizer(tiny_chat_dir)
    pool = PromptPool(tok, load_prompts(), seed=0)
    rows = [TraceRow(0.0, 300, 5), TraceRow(1.0, 3, 7), TraceRow(2.0, 5000, 10)]
    items = build_workload(rows, pool, context_length=1000)
    assert [len(i.prompt_ids) for i in items] == [300, 3, 990]
    assert [i.max_tokens for i in items] == [5, 7, 10]
    assert all(i.prompt_ids[0] == tok.bos_token_id for i in items)
    assert len({i.prompt_source for i in items}) == 3


def test_summary_counts_failures_against_the_slo() -> None:
    ok = RequestResult("p", 0, 0.0, 5, 4)
    ok.finish(0.2, 1.0, 4)
    slow = RequestResult("p", 1, 1.0, 5, 2)
    slow.finish(2.0, 3.0, 2)
    failed = RequestResult("p", 2, 2.0, 5, 2, error="rejected")
    s = summarize([ok, slow, failed], slo_s=1.0)
    assert (s["requests"], s["completed"], s["failed"], s["output_tokens"]) == (3, 2, 1, 6)
    assert ok.tpot_s == pytest.approx(0.8 / 3) and ok.per_token_s == pytest.approx(0.25)
    assert s["slo_attainment"] == pytest.approx(1 / 3)
    assert s["throughput_tok_s"] == pytest.approx(6 / 4.0)


def test_replay_command_writes_its_report(tiny_chat_dir, tmp_path: Path, capsys) -> None:  # noqa: F811
    out = tmp_path / "out"
    code = main(
        [
            "replay",
            "--model",
            str(tiny_chat_dir),
            "--duration",
            "3",
            "--length-scale",
            "0.02",
            "--max-new-tokens-cap",
            "3",
            "--max-wait-s",
            "0.05",
            "--offload-dir",
            str(tmp_path / "store"),
            "--policies",
            "activation-aware+activation-aware,none+lru",
            "--out",
            str(out),
            "--json",
        ]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary) == {"activation-aware+activation-aware", "none+lru"}
    n = len(load_trace(DEFAULT_TRACE, duration_s=3.0))
    for s in summary.values():
        assert s["requests"] == n and s["completed"] == n
        for key in (
            "ttft_p50_s",
            "ttft_p99_s",
            "tpot_p50_s",
            "tpot_p99_s",
            "throughput_tok_s",
            "slo_attainment",
        ):
            assert key in s
        assert s["runtime"]["hits"] + s["runtime"]["misses"] > 0
    with open(out / "requests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * n and all(not r["error"] for r in rows)
    for name in ("latency_cdf.png", "latency_vs_rate.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "summary.json").read_text())["policies"] == summary
    assert "| none+lru |" in (out / "summary.md").read_text()
