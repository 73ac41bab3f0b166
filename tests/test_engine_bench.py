"""`moeinf bench io` on a small packed store, and the bench dispatcher's error for a missing benchmark."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeinf.cli import main
from moeinf.commands.bench import MissingBenchmark, load


def test_bench_io_prints_one_json_object_with_the_figures(tiny_model_dir, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from moeinf.store import Store, pack

    store_dir = tmp_path / "store"
    pack(tiny_model_dir("qwen3_moe"), store_dir, progress=False)
    store = Store(store_dir)
    argv = ["bench", "io", str(store_dir), "--json", "--repeats", "2", "--samples", "3", "--slots", "4"]
    status = main(argv)
    assert status == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("engine_gbps", "raw_gbps", "ratio", "demand_p50_ms", "demand_p50_ideal_ms", "preempt_p50_ms",
                "store_bytes", "expert_bytes", "machine", "config"):
        assert key in result, key
    assert result["store_bytes"] == store.expert_bytes and result["expert_bytes"] == store.max_blob_size
    assert result["experts"] == len(store.index.experts) and len(result["runs"]) == 2
    assert result["ratio"] == pytest.approx(result["engine_gbps"] / result["raw_gbps"])
    assert min(r["engine_gbps"] / r["raw_gbps"] for r in result["runs"]) <= result["paired_ratio"]
    assert result["verify_cpu_s_per_gb"] > 0 and result["engine_cpu_s_per_gb"] > 0
    assert result["raw_pool_gbps"] > 0
    assert result["ratio_vs_raw_pool"] == pytest.approx(result["engine_gbps"] / result["raw_pool_gbps"])


def test_a_missing_benchmark_module_is_a_clear_error() -> None:
    with pytest.raises(MissingBenchmark, match="moeinf.bench.nonexistent is missing"):
        load("nonexistent")
