"""bench batch: the batch-cost rows from per-repeat measurements (no model needed)."""

from __future__ import annotations

import pytest

from moeinf.bench.batch import summarise


def _run(step_s: float) -> dict:
    return {"step_s": step_s, "times": [step_s] * 3, "experts_per_layer_all_steps": 4.0,
            "reads_per_step": 2.0, "hit_rate": 0.5}


def test_the_paired_ratio_compares_each_repeat_with_its_own_one_row_run() -> None:
    # the machine got 3x slower between the two repeats; each repeat's 8 rows cost 2x its one row
    runs = {1: [_run(0.010), _run(0.030)], 8: [_run(0.020), _run(0.060)]}
    one, eight = summarise(runs)
    assert one["cost_vs_one"] == one["cost_vs_one_paired"] == 1.0
    assert eight["cost_vs_one_paired"] == pytest.approx(2.0)
    assert eight["cost_vs_one"] == pytest.approx(0.040 / 0.020)  # pooled medians: 40 ms vs 20 ms
    assert eight["ms_per_row"] == pytest.approx(40.0 / 8)


def test_the_paired_ratio_is_not_fooled_by_repeats_at_different_loads() -> None:
    # two of three repeats ran the one-row step under a heavier load than their 8-row step
    runs = {1: [_run(0.010), _run(0.040), _run(0.040)], 8: [_run(0.020), _run(0.020), _run(0.080)]}
    eight = summarise(runs)[1]
    assert eight["cost_vs_one"] == pytest.approx(0.5)  # pooled: 20 ms over 40 ms
    assert eight["cost_vs_one_paired"] == pytest.approx(2.0)  # median of 2.0, 0.5, 2.0
