"""The batch planner's roofline on synthetic machines and models (no measurement, no model), the kernel
table's lookup, and route-aware ordering on signatures with a known structure."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moeinf.batch import planner
from moeinf.batch.grouping import route_order, signatures
from moeinf.batch.kernels import KernelRow, KernelTable
from moeinf.batch.roofline import Rates

TABLE = KernelTable(
    64,
    32,
    "float32",
    1,
    "test",
    [
        KernelRow(1, 1e-3, 2e-3),
        KernelRow(4, 1.2e-3, 1.5e-3),
        KernelRow(16, 4e-3, 2e-3),
        KernelRow(64, 16e-3, 5e-3),
    ],
)
RATES = Rates(drive_bps=1e9, memory_bps=10e9, matmul_flops=50e9)


def facts(**changes) -> planner.ModelFacts:
    base = planner.ModelFacts(
        layers=4,
        experts=16,
        top_k=2,
        hidden=64,
        intermediate=32,
        expert_bytes=8 << 20,
        dense_bytes=1 << 20,
        compute_dtype="float32",
        kv_bytes_per_token=4096,
        cache_experts=16,
        popularity=np.full((4, 16), 2 / 16),
    )
    return dataclasses.replace(base, **changes)


def test_the_kernel_table_interpolates_and_chooses_by_tokens_per_expert() -> None:
    assert TABLE.best(1) == "per_expert" and TABLE.best(16) == "grouped"
    assert TABLE.seconds(2, "per_expert") == 1e-3 + (1.2e-3 - 1e-3) * 0.5
    assert TABLE.seconds(128, "grouped") == 2 * 5e-3  # linear beyond the last point


def test_bigger_batches_read_fewer_bytes_per_token_and_the_pipeline_overlaps() -> None:
    f = facts()
    work = planner.Workload(prompts=64, prompt_tokens=10, new_tokens=8)
    one = planner.predict(f, RATES, TABLE, work, planner.Plan(1, True, "per_expert"), 1e12)
    many = planner.predict(f, RATES, TABLE, work, planner.Plan(32, True, "grouped"), 1e12)
    serial = planner.predict(f, RATES, TABLE, work, planner.Plan(32, False, "grouped"), 1e12)
    assert many.predicted_tokens_per_s > 4 * one.predicted_tokens_per_s
    assert many.predicted_tokens_per_s > serial.predicted_tokens_per_s
    b = many.breakdown
    cpu = b["step_experts_s"] + b["step_verify_s"] + b["step_dense_s"]
    assert b["step_s"] == max(b["step_io_s"], cpu)
    s = serial.breakdown
    # without the pipeline each layer's reads overlap only that layer's own expert compute
    assert max(s["step_io_s"], cpu) < s["step_s"] <= s["step_io_s"] + cpu + 1e-12


def test_checksums_take_cpu_from_the_compute_thread() -> None:
    work = planner.Workload(prompts=64, prompt_tokens=10, new_tokens=8)
    plan = planner.Plan(32, True, "grouped")
    fast = planner.predict(facts(), RATES, TABLE, work, plan, 1e12).breakdown
    slow = dataclasses.replace(RATES, drive_bps=1e12, verify_bps=1e9)  # checksums now bound the step
    checked = planner.predict(facts(), slow, TABLE, work, plan, 1e12).breakdown
    assert fast["step_verify_s"] == 0
    assert checked["step_verify_s"] == pytest.approx(checked["step_misses"] * (8 << 20) / 1e9, rel=1e-5)
    cpu = checked["step_experts_s"] + checked["step_verify_s"] + checked["step_dense_s"]
    assert checked["step_s"] == pytest.approx(cpu, rel=1e-5)


def test_a_coded_store_reads_and_checks_its_stored_bytes() -> None:
    work = planner.Workload(prompts=64, prompt_tokens=10, new_tokens=8)
    plan = planner.Plan(32, True, "grouped")
    slow = dataclasses.replace(RATES, verify_bps=1e9)
    exact = planner.predict(facts(), slow, TABLE, work, plan, 1e12).breakdown
    coded = planner.predict(facts(read_bytes=6 << 20), slow, TABLE, work, plan, 1e12).breakdown
    assert coded["step_misses"] == exact["step_misses"] > 0  # the same slots: decoded blobs in memory
    assert coded["step_io_s"] == pytest.approx(0.75 * exact["step_io_s"], rel=1e-9)
    assert coded["step_verify_s"] == pytest.approx(0.75 * exact["step_verify_s"], rel=1e-9)


def test_the_cache_keeps_popular_experts_only_beside_the_layer_being_computed() -> None:
    skewed = np.full((4, 16), 0.01)
    skewed[:, :2] = (2 - 14 * 0.01) / 2
    f = facts(popularity=skewed, cache_experts=10)  # 8 popular ones fit beside a layer's 2
    small = planner.pass_seconds(f, RATES, TABLE, 1, 10, 1, planner.Plan(1, False, "per_expert"))
    # one token: mostly the popular experts, which stay cached
    assert small["misses"] < 0.2 * planner._touched(skewed, 1).sum()
    big = planner.pass_seconds(f, RATES, TABLE, 256, 10, 256, planner.Plan(256, True, "per_expert"))
    # 256 tokens touch all 16 experts of a layer: no slot is left to keep experts across passes
    touched = planner._touched(skewed, 256).sum()
    assert big["misses"] == pytest.approx(touched * (1 - 10 / 64), rel=1e-6)


def test_a_cache_of_every_expert_reads_nothing_and_kv_memory_bounds_the_batch() -> None:
    work = planner.Workload(prompts=64, prompt_tokens=10, new_tokens=8)
    cached = planner.predict(
        facts(cache_experts=64), RATES, TABLE, work, planner.Plan(8, True, "grouped"), 1e12
    )
    assert cached.breakdown["step_io_s"] == 0
    kv = 8 * (10 * 1.5 + 8) * 4096
    assert planner.predict(facts(), RATES, TABLE, work, planner.Plan(8, True, "grouped"), kv).fits
    assert not planner.predict(facts(), RATES, TABLE, work, planner.Plan(16, True, "grouped"), kv).fits


def test_skewed_routing_touches_fewer_experts_than_uniform() -> None:
    skewed = np.full((4, 16), 0.01)
    skewed[:, :2] = (2 - 14 * 0.01) / 2
    work = planner.Workload(prompts=8, prompt_tokens=10, new_tokens=8)
    plan = planner.Plan(8, True, "grouped")
    uniform = planner.predict(facts(), RATES, TABLE, work, plan, 1e12).breakdown
    peaked = planner.predict(facts(popularity=skewed), RATES, TABLE, work, plan, 1e12).breakdown
    assert peaked["step_touched_per_layer"] < uniform["step_touched_per_layer"]


def test_route_order_puts_alike_prompts_in_one_batch() -> None:
    rng = np.random.default_rng(0)
    eams = np.zeros((12, 2, 8))
    kinds = rng.permutation([0] * 6 + [1] * 6)
    for i, kind in enumerate(kinds):
        eams[i, 0, 4 * kind : 4 * kind + 4] = rng.integers(1, 5, 4)  # kind 0: experts 0-3, kind 1: 4-7
    order = route_order(signatures(eams), lengths=[1] * 12, batch_size=6)
    assert sorted(order) == list(range(12))
    assert {int(kinds[i]) for i in order[:6]} in ({0}, {1})
    assert {int(kinds[i]) for i in order[6:]} in ({0}, {1})


def test_a_measured_prefill_rate_replaces_the_flops_estimate_of_prefill_passes_only() -> None:
    f, plan = facts(), planner.Plan(8, True, "grouped")
    measured = dataclasses.replace(RATES, prefill_token_s=1e-3)
    prefill = planner.pass_seconds(f, measured, TABLE, 8 * 10, 10, 8, plan)
    assert prefill["dense_s"] == pytest.approx(80 * 1e-3)
    step = planner.pass_seconds(f, measured, TABLE, 8, 12, 8, plan)
    assert step["dense_s"] == planner.pass_seconds(f, RATES, TABLE, 8, 12, 8, plan)["dense_s"]


def test_prefetched_experts_of_the_next_layer_take_slots_from_the_kept_ones() -> None:
    skewed = np.full((4, 16), 0.01)
    skewed[:, :2] = (2 - 14 * 0.01) / 2
    f = facts(popularity=skewed, cache_experts=10)
    demand = planner.pass_seconds(f, RATES, TABLE, 1, 10, 1, planner.Plan(1, False, "per_expert"))
    ahead = planner.pass_seconds(f, RATES, TABLE, 1, 10, 1, planner.Plan(1, True, "per_expert"))
    assert ahead["misses"] > demand["misses"]


def test_prefill_passes_of_a_join_each_pad_to_its_longest_prompt() -> None:
    f, plan = facts(), planner.Plan(8, True, "per_expert", join=2)
    even = planner.Workload(prompts=8, prompt_tokens=10, new_tokens=4, lengths=(10,) * 8)
    ragged = planner.Workload(prompts=8, prompt_tokens=10, new_tokens=4, lengths=(4, 16) * 4)
    sorted_ = dataclasses.replace(ragged, lengths=tuple(sorted(ragged.lengths)))
    passes = [planner.pass_seconds(f, RATES, TABLE, 2 * w, w, 2, plan)["seconds"] for w in (10, 16, 4)]
    assert planner.predict(f, RATES, TABLE, even, plan, 1e12).breakdown["prefill_s"] == \
        pytest.approx(4 * passes[0])  # 4 joins of 2 prompts
    assert planner.predict(f, RATES, TABLE, ragged, plan, 1e12).breakdown["prefill_s"] == \
        pytest.approx(4 * passes[1])  # each join padded to 16
    assert planner.predict(f, RATES, TABLE, sorted_, plan, 1e12).breakdown["prefill_s"] == \
        pytest.approx(2 * passes[2] + 2 * passes[1])  # length order pads less


def test_candidates_join_the_whole_batch_or_a_quarter_and_the_best_join_is_found() -> None:
    f = facts()
    work = planner.Workload(prompts=64, prompt_tokens=10, new_tokens=8, lengths=tuple(range(2, 66)))
    plans = [planner.predict(f, RATES, TABLE, work, p, 1e12)
             for p in planner.candidates(f, TABLE, work, "hybrid")]
    assert {p.join_rows for p in plans if p.batch_size == 32} == {32, 8}
    assert {p.join_rows for p in plans if p.batch_size == 2} == {2}
    best = planner.best_of(plans, 32, True)
    assert best.predicted_tokens_per_s == max(p.predicted_tokens_per_s for p in plans
                                              if p.batch_size == 32 and p.pipeline)
