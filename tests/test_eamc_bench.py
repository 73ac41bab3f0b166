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


def test_prediction_accuracy_on_a_raw_trace(tmp_path) -> None:
    import numpy as np

    from moeinf.bench.eamc import prediction_accuracy
    from moeinf.trace.rawtrace import RawTrace, write_raw

    rng = np.random.default_rng(0)
    traces = []
    for i in range(24):  # task 0 routes to experts {0, 1}, task 1 to {2, 3}; top-1, 2 layers
        base = 2 * (i % 2)

        def step(tokens: int, base: int = base) -> dict:
            return {layer: (rng.integers(base, base + 2, size=(tokens, 1)), np.ones((tokens, 1)))
                    for layer in range(2)}

        traces.append(RawTrace(f"s{i}", f"t{i % 2}", 2, 4, 1, [step(5), step(1), step(1), step(1)]))
    path = write_raw(tmp_path / "raw.jsonl", traces)
    result = prediction_accuracy(path, 4, seed=0)
    assert result["test"] == 6 and result["train"] == 18
    # The matched entry holds the right pair of experts (a miss only when a sequence used one expert of its
    # pair and the entry favours the other); popularity mixes both pairs.
    assert result["accuracy_eamc"] > 0.8 and result["accuracy_eamc"] > result["accuracy_popularity"] + 0.2
    assert result["accuracy_blend"] >= result["accuracy_prompt"]  # the prompt ranks first, ties filled
    # the runtime's mean: the prompt's and the matched pair outweigh popularity's four experts
    assert result["accuracy_mean"] > result["accuracy_popularity"] + 0.2
