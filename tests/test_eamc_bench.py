from __future__ import annotations

import json

from moeinf.bench.eamc import distribution_shift
from moeinf.commands.bench import run_one


def test_bench_eamc_json(capsys) -> None:
    assert run_one("eamc", ["--capacity", "20", "--layers", "6", "--experts", "16", "--matches", "1000",
                            "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (row,) = result["matching"]
    assert (row["capacity"], row["layers"], row["experts"], row["matches"]) == (20, 6, 16, 1000)
    for name in ("match", "prefill_match", "full_match"):
        assert 0 < row[f"{name}_us"] <= row[f"{name}_p99_us"]


def test_bench_eamc_quick_sweep_writes_jsonl(tmp_path, capsys) -> None:
    argv = ["--quick", "--sweep", "--layers", "4", "--experts", "8", "--out", str(tmp_path)]
    assert run_one("eamc", argv) == 0
    assert "full_match_us" in capsys.readouterr().out
    (line,) = (tmp_path / "eamc.jsonl").read_text().splitlines()
    assert [row["capacity"] for row in json.loads(line)["matching"]] == [10, 100, 300]


def test_distribution_shift_recovers() -> None:
    shift = distribution_shift(num_layers=6, num_experts=16, top_k=2, capacity=12, before=60, after=40,
                               rebuild_after=6)
    assert shift["accuracy"][0] < 0.6 * shift["baseline_accuracy"]
    assert shift["rebuilds"] >= 1 and shift["recovered_after"] is not None
    assert shift["recovered_after"] <= 20
