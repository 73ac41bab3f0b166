"""`moeinf bench e2e` on an inflated zoo model: every configuration, its ratios, and the token check."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from moeinf import zoo
from moeinf.bench import e2e
from moeinf.zoo.inflate import inflate


@pytest.fixture(scope="module")
def inflated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    small = zoo.get_model("tiny", cache_dir=tmp_path_factory.mktemp("zoo-cache"), threads=1, progress=False)
    return inflate(small, tmp_path_factory.mktemp("e2e") / "tiny-inflated", hidden=64, moe_intermediate=64)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    return parser.parse_args(argv)


def test_e2e_runs_every_configuration_with_identical_tokens(inflated: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "e2e.jsonl"
    args = parse(["--model-dir", str(inflated), "--cache", "50%", "--prompts", "1", "--warmup", "0",
                  "--new-tokens", "3", "--eamc-prompts", "2", "--eamc-new-tokens", "3", "--out", str(out),
                  "--variant", "strict:prefetch_min_probability=0.9,lookahead_depth=1"])
    assert e2e.run(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    names = [r["config"] for r in rows]
    assert names[:3] == ["hf-all-in-ram", "moeinf-all-resident", e2e.BASELINE]
    assert "topk" in names and any(n.endswith("(default)") for n in names)
    # a --variant is the default configuration with its settings, measured beside it
    default = next(r for r in rows if r["config"].endswith("(default)"))
    strict = next(r for r in rows if r["config"] == "strict")
    assert strict["knobs"] == {**default["knobs"], "prefetch_min_probability": 0.9, "lookahead_depth": 1}
    # the fitted eviction runs beside the fixed score, with the fit traced with the EAMC
    fitted = next(r for r in rows if r["config"] == e2e.FITTED)
    assert fitted["knobs"]["eviction"] == "fitted"
    assert (inflated.with_name(inflated.name + ".eviction.json")).is_file()
    for r in rows:
        assert r["tokens_match"] is True, r["config"]
        assert len(r["tokens"]) == 1 and len(r["tokens"][0]) == 3
    offloaded = [r for r in rows if r["cache"] == "50%"]
    lru = next(r for r in offloaded if r["config"] == e2e.BASELINE)
    assert lru["speedup_vs_lru"] == 1.0 and lru["bytes_vs_lru"] == 1.0
    for r in offloaded:
        assert r["bound_s"] == max(r["io_s"], r["compute_s"]) and r["vs_bound"] > 0
        # the decode steps read part of what every pass read; their bound uses only their bytes
        assert 0 <= r["decode_bytes_per_token"] * r["decode_steps"] <= r["stats"]["bytes_read"]
        assert r["io_decode_s"] == r["decode_bytes_per_token"] / r["raw_bandwidth"]["random_bps"] or \
            r["io_decode_s"] == r["decode_bytes_per_token"] / r["raw_bandwidth"]["sequential_bps"]
        assert r["vs_bound_decode"] == r["median_s"] / max(r["io_decode_s"], r["compute_s"])
        assert r["decode_stall_ms_per_token"] >= 0
        assert r["raw_bandwidth"]["random_bps"] > 0
    # The EAMC was traced on the small model the checkpoint was inflated from.
    assert e2e.trace_source(inflated) != inflated
    assert "on-demand-lru" in capsys.readouterr().out


def test_e2e_rounds_keep_every_round_and_report_the_medians(inflated: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "e2e.jsonl"
    args = parse(["--model-dir", str(inflated), "--cache", "50%", "--prompts", "1", "--warmup", "0",
                  "--new-tokens", "3", "--eamc-prompts", "2", "--eamc-new-tokens", "3", "--configs",
                  "on-demand-lru,hybrid", "--rounds", "3", "--out", str(out)])
    assert e2e.run(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    offloaded = [r for r in rows if r["cache"] == "50%"]
    rounds = [r for r in offloaded if r["round"] != "median"]
    assert [(r["round"], r["config"].split(" ")[0]) for r in rounds] == \
        [(turn, name) for turn in (1, 2, 3) for name in ("on-demand-lru", "hybrid")]
    for r in rounds:  # each round against its own LRU run
        lru = next(x for x in rounds if x["round"] == r["round"] and x["config"] == e2e.BASELINE)
        assert r["speedup_vs_lru"] == lru["median_s"] / r["median_s"]
    medians = {r["config"]: r for r in offloaded if r["round"] == "median"}
    assert len(medians) == 2
    for name, row in medians.items():
        own = [r for r in rounds if r["config"] == name]
        assert row["rounds"] == 3 and row["round_median_s"] == [r["median_s"] for r in own]
        assert row["median_s"] == sorted(r["median_s"] for r in own)[1]
        assert row["speedup_vs_lru"] == sorted(r["speedup_vs_lru"] for r in own)[1]
        assert row["tokens_match"] is True
    # every round is bound by its own all-in-RAM time: moeinf all resident, re-measured each round
    hf = next(r for r in rows if r["config"] == "hf-all-in-ram")
    resident = {r["round"]: r for r in rows if r["config"] == "moeinf-all-resident"}
    assert set(resident) == {1, 2, 3, "median"}
    for r in rounds:
        assert r["compute_s"] == min(hf["median_s"], resident[r["round"]]["median_s"])
        assert r["vs_bound"] == r["median_s"] / max(r["io_s"], r["compute_s"])
    assert "round 3 of 3" in capsys.readouterr().err


def test_rounds_rotate_the_configurations_after_the_baseline() -> None:
    configs = {e2e.BASELINE: {}, "a": {"x": 1}, "b": {}, "c": {}}
    orders = [[name for _, name, _ in e2e.round_order(["25%", "50%"], configs, turn)]
              for turn in (1, 2, 3, 4)]
    assert orders[0] == [e2e.BASELINE, "a", "b", "c"] * 2
    assert orders[1] == [e2e.BASELINE, "b", "c", "a"] * 2
    assert orders[2] == [e2e.BASELINE, "c", "a", "b"] * 2
    assert orders[3] == orders[0]
    assert e2e.round_order(["25%"], configs, 2)[3] == ("25%", "a", {"x": 1})
    assert [n for _, n, _ in e2e.round_order(["25%"], {e2e.BASELINE: {}}, 5)] == [e2e.BASELINE]


def test_rounds_without_a_reference_leave_the_token_check_unknown() -> None:
    rows = [{"cache": "25%", "config": "x", "median_s": s, "tokens_match": match}
            for s, match in ((0.2, None), (0.1, None), (0.3, None))]
    assert e2e.over_rounds(rows)[0]["tokens_match"] is None
    rows[1]["tokens_match"], rows[0]["tokens_match"], rows[2]["tokens_match"] = True, True, False
    assert e2e.over_rounds(rows)[0]["tokens_match"] is False


def test_e2e_refuses_unknown_configurations_in_one_line(inflated: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["--model-dir", str(inflated), "--prompts", "1", "--warmup", "0", "--new-tokens", "2",
                  "--eamc-prompts", "2", "--eamc-new-tokens", "2", "--configs", "nonsense"])
    assert e2e.run(args) == 2
    assert "unknown --configs" in capsys.readouterr().err


def test_variants_are_named_offload_config_settings_refused_in_one_line(
        inflated: Path, capsys: pytest.CaptureFixture[str]) -> None:
    given = ["a:prefetch_min_probability=0.5", "b: eviction=lru, prefetch=lookahead"]
    assert e2e.variant_settings(given) == {"a": {"prefetch_min_probability": 0.5},
                                           "b": {"eviction": "lru", "prefetch": "lookahead"}}
    for bad in (["prefetch_min_probability=0.5"], ["a:no_such_knob=1"], ["a:prefetch_min_probability=2"],
                ["a:eviction=lru", "a:eviction=lfu"], ["two words:eviction=lru"]):
        with pytest.raises(ValueError):
            e2e.variant_settings(bad)
    args = parse(["--model-dir", str(inflated), "--prompts", "1", "--warmup", "0", "--new-tokens", "2",
                  "--eamc-prompts", "2", "--eamc-new-tokens", "2", "--variant", "a:prefetch=soonest"])
    assert e2e.run(args) == 2
    err = capsys.readouterr().err
    assert "--variant" in err and "prefetch" in err and len(err.strip().splitlines()) == 1


def test_step_clock_counts_the_growth_between_the_first_and_last_decode_step() -> None:
    counter = iter([(100.0, 1.0), (150.0, 1.5), (190.0, 2.5)])
    clock = e2e.StepClock(lambda: next(counter))
    scores = e2e.torch.zeros(1, 4)
    for _ in range(3):
        assert clock(e2e.torch.zeros(1, 1, dtype=e2e.torch.long), scores) is scores
    assert clock.decode_growth() == (90.0, 1.5)
    assert len(clock.token_latencies()) == 2
    assert e2e.StepClock().decode_growth() == ()


def test_the_timed_kernel_passes_every_kind_of_call_on_and_clocks_it() -> None:
    """The benchmark's timing wrapper keeps the kernel's several-experts calls (`many`, `rows_into`): without
    them the runtime falls back to one expert at a time, a path no user runs."""
    import time

    import torch

    from moeinf.bench.decode_profile import Clocks, TimedKernel
    from moeinf.kernels.moe import ExpertKernel

    class Slow(ExpertKernel):
        def __init__(self) -> None:
            self.calls: list[str] = []

        def __call__(self, x, tensors):
            self.calls.append("one")
            time.sleep(0.002)
            return x

        def many(self, x, tensors):
            self.calls.append("many")
            time.sleep(0.002)
            return x

        def rows_into(self, x, tensors, slots, weights, buffer):
            self.calls.append("rows_into")
            time.sleep(0.002)
            return True

    inner, clocks = Slow(), Clocks()
    timed = TimedKernel(inner, clocks)
    x = torch.zeros(1, 4)
    assert timed(x, {}) is x and timed.many(x, [{}]) is x
    assert timed.rows_into(x, [{}], [0], torch.ones(1), lambda dtype, width: x) is True
    assert inner.calls == ["one", "many", "rows_into"]
    assert clocks.kernel_s >= 3 * 0.002


@pytest.mark.parametrize("cache, why", [("500%", "0-100%"), ("abc", "cannot parse size"),
                                        ("25%,1.5", "must lie in [0, 1]")])
def test_a_bad_cache_size_is_refused_before_any_model_is_built(tmp_path: Path, cache: str, why: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    # the model directory does not exist: refusing later would first build (minutes), here nothing is made
    args = parse(["--model-dir", str(tmp_path / "never-built"), "--cache", cache])
    assert e2e.run(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0] and "--cache" in err[0]
    assert not (tmp_path / "never-built").exists()
