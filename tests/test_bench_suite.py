"""`moeinf bench all` (suite machinery and report.md) and the accelerate disk-offload baseline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from moeinf.commands import bench


def run_bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench.run(parser.parse_args(argv))


def test_suite_reports_every_benchmark_and_survives_a_failure(tmp_path: Path) -> None:
    out = tmp_path / "suite"
    # io fails (no store at that path); cache and eamc run on synthetic workloads in quick mode.
    status = run_bench(["all", "--quick", "--synthetic", "--only", "cache,eamc,io",
                        "--store", str(tmp_path / "no-such-store"), "--out", str(out)])
    assert status == 1
    report = (out / "report.md").read_text()
    for section in ("## Machine", "## Commands", "## cache", "## eamc", "## io"):
        assert section in report
    io_section = report.split("## io", 1)[1]
    assert "**FAILED**" in io_section
    assert "**FAILED**" not in report.split("## io", 1)[0]
    assert "moeinf bench cache --quick --out" in report
    assert "load_average" in report and "transformers" in report
    # the cache table has the oracle and one row per cache size written by the benchmark
    rows = [json.loads(line) for line in (out / "cache" / "cache.jsonl").read_text().splitlines()]
    assert "oracle" in report.split("## cache", 1)[1].split("## ", 1)[0]
    assert len({r["cache_fraction"] for r in rows}) >= 2
    assert "match_us" in report
    assert "![cache](cache/cache.png)" in report


def test_suite_rejects_unknown_benchmark(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown benchmarks"):
        run_bench(["all", "--quick", "--synthetic", "--only", "nope", "--out", str(tmp_path)])


def test_single_benchmark_failure_is_an_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert run_bench(["io", str(tmp_path)]) != 0


def test_accelerate_baseline_on_tiny_model(tiny_model_dir, tmp_path: Path) -> None:
    from moeinf.bench.accelerate_baseline import accelerate_token_latency

    model_dir = tiny_model_dir("qwen3_moe")
    result = accelerate_token_latency(model_dir, ["Hello there", "What is two plus two?"], 4, cache=0.25,
                                      drop_caches=True, offload_folder=tmp_path / "offload")
    assert result["median_s"] > 0
    assert len(result["latencies"]) == 3  # 4 new tokens, prefill excluded, one measured prompt
    plan = result["plan"]
    assert 0 < plan["expert_layers_on_disk"] <= plan["expert_layers"]
    assert plan["experts_in_ram_bytes"] <= plan["expert_budget_bytes"]
    assert result["offload_files"] > 0
    assert "memory-maps" in result["note"]


@pytest.mark.parametrize("flags", [["--quick"], [], ["--quick", "--synthetic"]])
def test_every_step_the_suite_plans_parses_as_its_command_would(flags: list[str], tmp_path: Path) -> None:
    """Each benchmark step of `moeinf bench all` gets past its benchmark's own parser (a flag or value a
    benchmark no longer takes would fail only at its turn, minutes into the suite)."""
    from moeinf.bench.report import add_suite_arguments, plan

    parser = argparse.ArgumentParser()
    add_suite_arguments(parser)
    args = parser.parse_args([*flags, "--out", str(tmp_path)])
    from moeinf.zoo import shipped_dir

    steps = plan(args, tmp_path, shipped_dir("demo"), tmp_path / "store")
    names = {step.argv[1] for step in steps if step.argv[0] == "bench"}
    assert names == {"io", "eamc", "cache", "prefetch", "e2e", "accelerate"}
    from moeinf.cli import build_parser

    for step in steps:
        if step.argv[0] == "bench":
            name = step.argv[1]
            bench.bench_parser(name, bench.load(name)).parse_args(step.argv[2:])  # exits on a bad argument
        else:  # the zoo model's trace, which the trace readers replay
            assert step.argv[0] == "trace" and "--synthetic" not in flags
            build_parser().parse_args(step.argv)
