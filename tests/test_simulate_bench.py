from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from moeinf.bench import cache, prefetch
from moeinf.trace.rawtrace import RawTrace, write_raw


def raw_traces(count: int, *, num_layers: int = 3, num_experts: int = 6, top_k: int = 2) -> list[RawTrace]:
    """Requests whose tokens reuse a per-request pair of experts per layer, plus some noise."""
    rng = np.random.default_rng(0)
    traces = []
    for index in range(count):
        favourite = [rng.choice(num_experts, size=top_k, replace=False) for _ in range(num_layers)]
        steps = []
        for tokens in [4] + [1] * 6:
            step = {}
            for layer in range(num_layers):
                ids = np.stack([favourite[layer] if rng.random() < 0.8
                                else rng.choice(num_experts, size=top_k, replace=False)
                                for _ in range(tokens)])
                step[layer] = (ids, np.full(ids.shape, 0.5, dtype=np.float32))
            steps.append(step)
        traces.append(RawTrace(f"r{index}", "test", num_layers, num_experts, top_k, steps))
    return traces


def parse(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    return write_raw(tmp_path_factory.mktemp("raw") / "raw.jsonl", raw_traces(6))


def test_bench_cache_on_a_raw_trace(trace_file, tmp_path, capsys):
    argv = ["--quick", "--json", "--traces", str(trace_file), "--out", str(tmp_path)]
    assert cache.run(parse(cache, argv)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"] == str(trace_file)
    rows = report["results"]
    assert {row["policy"] for row in rows} == set(cache.POLICIES)
    for fraction in {row["cache_fraction"] for row in rows}:
        at = {row["policy"]: row["hit_ratio"] for row in rows if row["cache_fraction"] == fraction}
        assert at["oracle"] == max(at.values())
    assert len((tmp_path / "cache.jsonl").read_text().splitlines()) == len(rows)
    assert (tmp_path / "cache.png").stat().st_size > 0


def test_top1_proxy_keeps_the_highest_gate_expert_per_token():
    """--top1: one expert per token and layer, the highest-gate one (the first listed without weights);
    a dropped token (-1) counts nowhere."""
    ids = np.array([[3, 1], [2, 5], [-1, 4]])
    weights = np.array([[0.2, 0.8], [0.6, 0.4], [0.9, 0.1]], dtype=np.float32)
    raw = RawTrace("r", "t", 2, 6, 2, [{0: (ids, weights), 1: (ids, np.zeros(0, dtype=np.float32))}])
    counts = cache.top1_counts(raw)
    assert counts.shape == (1, 2, 6)
    np.testing.assert_array_equal(counts[0, 0], [0, 1, 1, 0, 0, 0])  # 1 (0.8), 2 (0.6), the drop nowhere
    np.testing.assert_array_equal(counts[0, 1], [0, 0, 1, 1, 0, 0])  # first listed: 3, 2, the drop nowhere


def test_bench_cache_top1_proxy_on_a_raw_trace(trace_file, capsys):
    argv = ["--quick", "--json", "--top1", "--traces", str(trace_file)]
    assert cache.run(parse(cache, argv)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["top_k"] == 1 and report["top1_proxy"] is True
    assert report["accesses"] > 0


def test_gate_weighted_counts():
    """--gate-weights: a token counts k x its gate weight (top-1: its weight); a weight of 0 still marks an
    access, and a trace holding 1/k counts exactly as without weights."""
    ids = np.array([[3, 1], [2, 5], [-1, 4]])
    weights = np.array([[0.2, 0.8], [0.6, 0.4], [1.0, 0.0]], dtype=np.float32)
    raw = RawTrace("r", "t", 1, 6, 2, [{0: (ids, weights)}])
    counts = raw.step_counts(weighted=True)
    np.testing.assert_allclose(counts[0, 0], [0, 1.6, 1.2, 0.4, 1e-6, 0.8], rtol=1e-5)
    np.testing.assert_array_equal(np.count_nonzero(counts[0, 0]), np.count_nonzero(raw.step_counts()[0, 0]))
    np.testing.assert_allclose(cache.top1_counts(raw, weighted=True)[0, 0], [0, 0.8, 0.6, 0, 0, 0], rtol=1e-5)
    even = RawTrace("r", "t", 1, 6, 2, [{0: (ids, np.full(ids.shape, 0.5, dtype=np.float32))}])
    np.testing.assert_array_equal(even.step_counts(weighted=True), even.step_counts())


def test_bench_cache_gate_weights_change_only_the_scores(tmp_path, capsys):
    """Gate weights reach the running counts the scores read, never what LRU, LFU or the oracle see."""
    traces = raw_traces(6)
    rng = np.random.default_rng(1)
    for trace in traces:
        for step in trace.steps:
            for layer, (ids, _) in list(step.items()):
                first = rng.uniform(0.5, 1.0, size=len(ids)).astype(np.float32)
                step[layer] = (ids, np.stack([first, 1 - first], axis=1))
    path = write_raw(tmp_path / "weighted.jsonl", traces)
    reports = []
    for extra in ([], ["--gate-weights"]):
        assert cache.run(parse(cache, ["--quick", "--json", "--traces", str(path), *extra])) == 0
        reports.append(json.loads(capsys.readouterr().out))
    plain, weighted = ({(row["policy"], row["capacity"]): row["hits"] for row in report["results"]}
                       for report in reports)
    assert weighted.keys() == plain.keys() and reports[1]["gate_weights"] is True
    for policy in ("lru", "lfu", "oracle"):
        assert all(weighted[key] == plain[key] for key in plain if key[0] == policy)
    with pytest.raises(SystemExit, match="--gate-weights needs --traces"):
        cache.run(parse(cache, ["--quick", "--gate-weights"]))


def test_bench_prefetch_on_a_raw_trace(trace_file, capsys):
    argv = ["--quick", "--json", "--traces", str(trace_file), "--eamc-capacity", "3"]
    assert prefetch.run(parse(prefetch, argv)) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["results"]
    assert {row["sweep"] for row in rows} == {"bandwidth"}
    assert {(row["policy"], row["refine"]) for row in rows} >= {("activation-aware", True),
                                                                ("activation-aware", False), ("none", True)}
    assert all(0.0 <= row["recall"] <= 1.0 and 0.0 <= row["precision"] <= 1.0 for row in rows)


def test_bench_cache_times_the_victim_choice(capsys):
    assert cache.run(parse(cache, ["--victim-only"])) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cached"] == 1536
    assert set(report["median_us"]) >= {"activation-aware", "lru", "lfu", "neighbor"}
    assert all(value > 0 for value in report["median_us"].values())


def test_bench_cache_refuses_a_bad_trace_in_one_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(raw_traces(1)[0].to_json() + "\n{oops\n")
    with pytest.raises(SystemExit, match=r"moeinf bench cache: error: .*bad.jsonl:2: bad record"):
        cache.run(parse(cache, ["--traces", str(path)]))


TRACE = Path(__file__).resolve().parents[1] / "../shared/data/traces/dsv2lite-puffin-700.jsonl.gz"


@pytest.mark.skipif(not TRACE.exists(),
                    reason="the DeepSeek-V2-Lite trace (../shared/data/traces) is not on this machine")
def test_the_real_trace_streams():
    from moeinf.trace.rawtrace import read_step_counts

    _, _, top_k, counts = next(iter(read_step_counts(TRACE)))
    assert top_k == 6 and counts.shape[1:] == (26, 64)
    assert (counts[1:].sum(axis=2) == 6).all()  # one token per decode step, top-6 at every layer
