"""Trace replay: trace parsing and scaling, exact-length prompts, and the command end to end."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from test_serve_helpers import load_test_tokenizer, tiny_chat_dir  # noqa: F401

from moeinf.cli import main
from moeinf.replay.report import comparison, summarize
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
            str(tiny_chat_dir),
            "--duration",
            "3",
            "--length-scale",
            "0.02",
            "--max-new-tokens",
            "3",
            "--max-wait-s",
            "0.05",
            "--device-cache",
            "50%",
            "--offload-dir",
            str(tmp_path / "store"),
            "--batching",
            "static",
            "continuous",
            "--rps-scale",
            "1",
            "2",
            "--out",
            str(out),
            "--json",
        ]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary) == {"static x1", "static x2", "continuous x1", "continuous x2"}
    n = len(load_trace(DEFAULT_TRACE, duration_s=3.0))
    for label, s in summary.items():
        assert s["requests"] == n and s["completed"] == n
        assert f"{s['batching']} x{s['rps_scale']:g}" == label
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
    assert {s["rps_scale"] for s in summary.values()} == {1.0, 2.0}
    with open(out / "requests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 * n and all(not r["error"] for r in rows)
    for name in ("ttft_cdf.png", "tpot_cdf.png", "latency_cdf.png", "slo_vs_rate.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "summary.json").read_text())["runs"] == summary
    assert "| continuous x2 |" in (out / "summary.md").read_text()


def _run_summary(batching: str, rate: float, slo: float, ttft_p99: float, tok_s: float) -> dict:
    return {
        "policy": "p",
        "batching": batching,
        "rps_scale": rate,
        "slo_attainment": slo,
        "ttft_p99_s": ttft_p99,
        "throughput_tok_s": tok_s,
    }


def test_comparison_picks_the_highest_rate_static_still_serves() -> None:
    summary = {
        "s1": _run_summary("static", 1, 0.95, 2.0, 10.0),
        "s2": _run_summary("static", 2, 0.91, 4.0, 20.0),
        "s4": _run_summary("static", 4, 0.50, 9.0, 25.0),
        "c1": _run_summary("continuous", 1, 1.0, 0.5, 10.0),
        "c2": _run_summary("continuous", 2, 1.0, 1.0, 21.0),
        "c4": _run_summary("continuous", 4, 0.9, 2.0, 30.0),
    }
    (row,) = comparison(summary)
    assert row["rps_scale"] == 2 and row["ttft_p99_ratio"] == pytest.approx(4.0)
    assert (row["static_throughput_tok_s"], row["continuous_throughput_tok_s"]) == (20.0, 21.0)
    assert comparison({k: v for k, v in summary.items() if k.startswith("s")}) == []


def test_broken_prompt_jsonl_names_file_and_line(tiny_chat_dir, tmp_path: Path, capsys) -> None:  # noqa: F811
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "fine"}\n\n{"prompt": "cut\n')
    code = main(["replay", str(tiny_chat_dir), "--prompts", str(bad), "--duration", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert f"{bad}:3: not a JSON object" in err[0]


@pytest.mark.parametrize("flag", ["--trace", "--prompts"])
def test_a_missing_trace_or_prompts_file_is_a_usage_error(tiny_chat_dir, tmp_path: Path, capsys,  # noqa: F811
                                                          flag: str) -> None:
    code = main(["replay", str(tiny_chat_dir), flag, str(tmp_path / "absent"), "--duration", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"moeinf replay: error: argument {flag}: {tmp_path / 'absent'} ")


def test_an_out_that_is_a_file_is_refused_before_replaying(tiny_chat_dir, tmp_path: Path,  # noqa: F811
                                                            capsys) -> None:
    notes = tmp_path / "notes.md"
    notes.write_text("mine\n")
    assert main(["replay", str(tiny_chat_dir), "--out", str(notes)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a file" in err[0] and notes.read_text() == "mine\n"


@pytest.mark.parametrize("path", ["missing", "file"])
def test_replay_refuses_a_path_that_is_no_model(tmp_path: Path, capsys, path: str) -> None:
    target = tmp_path / path
    if path == "file":
        target.write_text("x")
    code = main(["replay", str(target)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and str(target) in err[0]


def test_replay_against_a_dead_port_fails_with_one_line(tiny_chat_dir, capsys) -> None:  # noqa: F811
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = main(
        ["replay", str(tiny_chat_dir), "--duration", "1", "--url", f"http://127.0.0.1:{port}"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "cannot reach" in err[0] and "moeinf serve" in err[0]


def test_replay_gives_the_scheduler_flags_to_its_batcher(tiny_chat_dir, tmp_path: Path, monkeypatch,  # noqa: F811
                                                          capsys) -> None:
    import moeinf.replay.runner
    from moeinf.serve.batcher import MAX_BATCH, Batcher

    made: list[Batcher] = []

    class Recording(Batcher):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(moeinf.replay.runner, "Batcher", Recording)
    knobs = {"join_wait_s": 0.2, "join_hold_tokens": 64, "join_min_rows": 2, "prefill_padding": 1.25}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in knobs.items()]
    out = tmp_path / "out"
    code = main(["replay", str(tiny_chat_dir), "--duration", "2", "--length-scale", "0.02",
                 "--max-new-tokens", "2", "--no-offload", "--out", str(out), "--json", *flags])
    assert code == 0, capsys.readouterr().err
    (batcher,) = made
    assert {k: getattr(batcher, k) for k in knobs} == knobs
    assert batcher.max_batch == MAX_BATCH["continuous"]  # each scheduler's own default
    report = json.loads((out / "summary.json").read_text())
    assert {k: report["meta"][k] for k in knobs} == knobs
    assert report["runs"]["continuous x1"]["max_batch"] == MAX_BATCH["continuous"]
