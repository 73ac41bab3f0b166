"""The fitted eviction policy: the score family, its fit by replay, save/load beside the EAMC, the same
decisions in the simulator and through the runtime's calls, and the online refit."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest

from moeinf.policy import EvictionContext, PolicyError, make_eviction, make_prefetch
from moeinf.policy.fitted import (
    FIXED,
    GRID,
    PASSES,
    EvictionFit,
    FittedEviction,
    Setting,
    access_counts,
    fit_eviction,
    fit_path,
    load_fit_beside,
    mean_top_k,
    request_counts,
)
from moeinf.policy.simulate import simulate
from moeinf.policy.synthetic import SyntheticModel

SMALL_GRID = {"follow": (0.0, 0.5), "recency": (0.5, 0.95), "shape": (0.0, 1.0), "carry": (0.0, 0.3)}


def workload(sequences: int = 10, seed: int = 1) -> list[np.ndarray]:
    model = SyntheticModel(num_layers=5, num_experts=12, top_k=2, reuse=0.75, seed=7)
    traces, _ = model.traces(sequences, seed=seed)
    return traces


def test_setting_for_takes_the_nearest_fraction_in_log_scale():
    fit = EvictionFit(4, 25, 2.0, [0.05, 0.2, 0.6],
                      [Setting(recency=0.5), Setting(recency=0.7), Setting(recency=0.9)])
    assert fit.setting_for(5).recency == 0.5  # 5% of 100
    assert fit.setting_for(9).recency == 0.5  # 9% is nearer 5% than 20% in log scale (ratio 1.8 vs 2.2)
    assert fit.setting_for(11).recency == 0.7
    assert fit.setting_for(100).recency == 0.9
    policy = FittedEviction(4, 25, fit)
    assert policy.params[5] == 1.0 and policy.setting == FIXED  # no capacity yet: the fixed constants
    policy.set_capacity(60)
    assert policy.setting.recency == 0.9


def test_fit_round_trips_beside_the_eamc(tmp_path):
    fit = EvictionFit(3, 8, 2.5, [0.1, 0.5], [Setting(shape=1.0, carry=0.1), Setting(follow=0.25)],
                      {"fit_s": 1.5})
    path = fit.save(fit_path(tmp_path / "model.eamc"))
    assert path.name == "model.eviction.json"
    back = EvictionFit.load(path)
    assert back.to_json() == fit.to_json()
    assert load_fit_beside(tmp_path / "model.eamc", 3, 8).to_json() == fit.to_json()
    assert load_fit_beside(tmp_path / "other.eamc", 3, 8) is None and load_fit_beside(None, 3, 8) is None
    with pytest.raises(PolicyError, match="re-run `moeinf trace` on this model"):
        load_fit_beside(tmp_path / "model.eamc", 3, 9)
    path.write_text('{"format": "other"}')
    with pytest.raises(PolicyError, match="re-run `moeinf trace`"):
        EvictionFit.load(path)
    with pytest.raises(PolicyError, match="3 x 8 experts"):
        FittedEviction(4, 8, fit)


def test_expected_distance_score_orders_by_chance_and_layer_distance():
    """shape > 0: minus ahead + 1 + shape * L * (1 / (k * share) - 1). With one token of layer 0 seen,
    its expert is used again with chance 1 (k = 1): it goes last, however far its layer; experts without
    any use go by layer distance, the nearest layer kept."""
    policy = FittedEviction(3, 4, top_k=1.0)
    policy.use(Setting(recency=1.0, follow=0.0, prior_tokens=0.0, shape=1.0))
    for key in [(0, 1), (0, 2), (1, 3), (2, 0)]:
        policy.on_insert(key)
    eam = np.zeros((3, 4))
    eam[0, 1] = 1.0
    ctx = EvictionContext(cur_eam=eam, layer=0)
    assert policy.victims(ctx, 4) == [(0, 2), (2, 0), (1, 3), (0, 1)]


def test_two_time_scales_keep_what_the_sequence_used_long_ago():
    """mix > 0: the share also reads the sequence's counts on the slow scale. Expert 1 served the
    sequence's first six tokens, expert 3 one token three tokens ago: on the fast scale alone (decay 0.5)
    expert 1 has faded below expert 3 and leaves first; with the slow scale (no decay) weighing 3/4,
    its six uses keep it and expert 3 leaves first."""
    order = {}
    for mix in (0.0, 0.75):
        policy = FittedEviction(2, 4, top_k=1.0)
        policy.use(Setting(recency=0.5, follow=0.0, prior_tokens=0.0, shape=-1.0, mix=mix, slow=1.0))
        policy.on_insert((0, 1))
        policy.on_insert((0, 3))
        eam = np.zeros((2, 4))
        for expert in [1] * 6 + [2] * 2 + [3] + [2] * 3:
            eam[0, expert] += 1.0
            policy.victims(EvictionContext(cur_eam=eam.copy(), layer=0), 1)  # one decision per token
        order[mix] = policy.victims(EvictionContext(cur_eam=eam.copy(), layer=0), 2)
    assert order[0.0] == [(0, 1), (0, 3)]
    assert order[0.75] == [(0, 3), (0, 1)]


def test_a_fit_without_the_slow_scale_loads_as_one_scale(tmp_path):
    """A fit file written before `mix` / `slow` existed reads as mix 0: the score it was fit with."""
    record = EvictionFit(3, 8, 1.0, [0.5], [Setting(recency=0.9)]).to_json()
    for row in record["rows"]:
        del row["mix"], row["slow"]
    setting = EvictionFit.from_json(record).settings[0]
    assert (setting.mix, setting.recency) == (0.0, 0.9)
    params = np.zeros_like(FittedEviction(3, 8).params)
    setting.apply(params, 1.0)
    from moeinf.policy import kernels
    assert params[kernels.P_MIX] == 0.0


def test_fit_never_loses_to_the_fixed_score_on_what_it_replays():
    traces = workload(12)
    fit = fit_eviction(traces, fractions=(0.2, 0.5), grid=SMALL_GRID, max_accesses=1500, seed=0)
    assert len(fit.settings) == 2 and fit.meta["replayed_requests"] >= 1
    assert fit.top_k == pytest.approx(mean_top_k(traces))
    assert 1.0 <= fit.top_k <= 2.0
    # the replayed part, rebuilt as fit_eviction splits it
    order = np.random.default_rng(0).permutation(len(traces))
    replayed = [traces[i] for i in np.sort(order[: fit.meta["replayed_requests"]])]
    seeding = [traces[i] for i in order[fit.meta["replayed_requests"]:]]
    counts = sum(np.count_nonzero(t, axis=0) for t in seeding)
    for fraction, setting in zip(fit.fractions, fit.settings, strict=True):
        capacity = max(round(fraction * 60), max(int(np.count_nonzero(t, axis=2).max()) for t in replayed))
        fitted = FittedEviction(5, 12, fit)
        fitted.set_capacity(capacity)
        assert fitted.setting == setting
        fixed = FittedEviction(5, 12)
        assert (simulate(replayed, capacity, fitted, counts=counts).hits
                >= simulate(replayed, capacity, fixed, counts=counts).hits)


def test_the_fit_is_the_same_on_one_thread_and_on_several():
    """Replaying a constant's values side by side must take the settings one by one would (the first with
    the most hits), on a grid where several values tie."""
    traces = workload(12)
    # `slow` changes nothing while `mix` stays 0: its values tie, and the first must stay
    grid = {**SMALL_GRID, "first_use": (0.0, 8.0, 64.0), "carry": (0.0, 0.1, 0.3), "slow": (1.0, 0.98, 0.995)}
    one = fit_eviction(traces, fractions=(0.1, 0.2, 0.5), grid=grid, max_accesses=1500, seed=1, workers=1)
    three = fit_eviction(traces, fractions=(0.1, 0.2, 0.5), grid=grid, max_accesses=1500, seed=1, workers=3)
    assert one.settings == three.settings and all(s.slow == 1.0 for s in one.settings)
    assert one.meta["candidates"] == three.meta["candidates"]
    # and both are the plain one-by-one coordinate search, rebuilt here on the same split
    order = np.random.default_rng(1).permutation(len(traces))
    take = one.meta["replayed_requests"]
    replayed = [traces[i] for i in np.sort(order[:take])]
    seeding = [traces[i] for i in order[take:]]
    counts, firsts = access_counts(seeding), request_counts(seeding)
    busiest = max(int(np.count_nonzero(t, axis=2).max()) for t in replayed)
    start = FIXED
    for fraction, fitted in zip((0.1, 0.2, 0.5), one.settings, strict=True):
        capacity = max(busiest, round(fraction * 60))

        def hits(setting, capacity=capacity):
            policy = FittedEviction(5, 12, top_k=one.top_k)
            policy.use(setting)
            return simulate(replayed, capacity, policy, counts=counts, firsts=firsts).hits

        best, best_hits = start, hits(start)
        if hits(FIXED) > best_hits:
            best, best_hits = FIXED, hits(FIXED)
        for _ in range(PASSES):
            before = best
            for name, values in grid.items():
                for value in values:
                    candidate = Setting(**{**asdict(best), name: value})
                    if hits(candidate) > best_hits:
                        best, best_hits = candidate, hits(candidate)
            if best == before:
                break
        assert fitted == best
        start = best


@pytest.mark.parametrize("setting", [Setting(shape=1.0, carry=0.3, follow=0.5),
                                     Setting(shape=-1.0, carry=0.1),
                                     Setting(shape=0.3, recency=0.95, follow=0.0),
                                     Setting(shape=0.3, recency=0.5, mix=0.5, slow=0.995, carry=0.1),
                                     Setting(mix=0.25, slow=1.0, follow=0.5),
                                     Setting(shape=0.3, recency=0.5, mix=0.25, slow=0.995, first_use=64.0),
                                     Setting(follow=0.5, first_use=8.0)])
def test_compiled_replay_matches_the_runtime_calls(setting):
    """One implementation: the simulator's compiled replay and the Python replay, which calls `victims`
    as the runtime's cache does, take the same decisions for every form of the family (carry included:
    each sequence restarts the running EAM), and count the same (first uses included)."""
    traces = workload(6, seed=3)
    seeding = workload(4, seed=9)
    counts = sum(np.count_nonzero(t, axis=0) for t in seeding)
    firsts = request_counts(seeding)
    capacity = max(int(np.count_nonzero(t, axis=2).max()) for t in traces) + 10
    compiled_policy, python_policy = FittedEviction(5, 12, top_k=2.0), FittedEviction(5, 12, top_k=2.0)
    compiled_policy.use(setting)
    python_policy.use(setting)
    compiled = simulate(traces, capacity, compiled_policy, counts=counts, firsts=firsts)
    python = simulate(traces, capacity, python_policy, make_prefetch("none", 5, 12), counts=counts,
                      firsts=firsts)
    assert (compiled.hits, compiled.misses) == (python.hits, python.misses)
    assert 0 < compiled.hits < compiled.accesses
    np.testing.assert_array_equal(compiled_policy.stamp, python_policy.stamp)
    np.testing.assert_array_equal(compiled_policy.running, python_policy.running)
    np.testing.assert_array_equal(compiled_policy.count, python_policy.count)
    # the seed's first uses weigh first_use, and the replay's first uses add to them
    accessed = sum(np.count_nonzero(t, axis=0) for t in traces).ravel()
    seeded = counts.ravel() + setting.first_use * firsts.ravel()
    assert (compiled_policy.count >= seeded + accessed).all()
    if setting.first_use == 0.0:
        np.testing.assert_array_equal(compiled_policy.count, seeded + accessed)
    else:
        assert compiled_policy.count.sum() > (seeded + accessed).sum()


def test_first_use_ranks_what_the_sequence_has_not_used_by_how_many_requests_use_it():
    """Expert 1 served one earlier request ten times, expert 2 four requests once each; the running
    sequence has used neither. Counting accesses, expert 2 (4 against 10) leaves first; weighing each
    request's first use 64 times more, expert 1 (10 + 64 against 4 + 4 x 64) does (expert 3, which the
    sequence is using, is protected). The sequence's own first use of expert 3 counts 1 + 64 once its
    layer is folded in, a second use 1 more, and a new sequence's first use 64 again."""
    counts = np.zeros((2, 4))
    counts[0, 1], counts[0, 2] = 10, 4
    firsts = np.zeros((2, 4))
    firsts[0, 1], firsts[0, 2] = 1, 4
    order = {}
    for first_use in (0.0, 64.0):
        policy = FittedEviction(2, 4, top_k=1.0)
        policy.use(Setting(recency=0.5, follow=0.0, prior_tokens=8.0, shape=-1.0, first_use=first_use))
        policy.reset(counts, firsts)
        assert policy.count[1] == 10 + first_use and policy.count[2] == 4 + 4 * first_use
        for expert in (1, 2, 3):
            policy.on_insert((0, expert))
        eam = np.zeros((2, 4))
        eam[0, 3] = 1.0
        policy.on_access((0, 3))
        order[first_use] = policy.victims(EvictionContext(cur_eam=eam.copy(), layer=1,
                                                          protected=frozenset({(0, 3)})), 1)
        assert policy.count[3] == 1 + first_use
        eam[0, 3] = 2.0
        policy.on_access((0, 3))
        policy.victims(EvictionContext(cur_eam=eam.copy(), layer=1), 1)
        assert policy.count[3] == 2 + first_use
        policy.on_access((0, 3))  # a new sequence (its EAM restarts) uses expert 3 first
        policy.victims(EvictionContext(cur_eam=np.where(np.arange(8).reshape(2, 4) == 3, 1.0, 0.0),
                                       layer=1), 1)
        assert policy.count[3] == 3 + 2 * first_use
    assert order[0.0] == [(0, 2)]
    assert order[64.0] == [(0, 1)]
    with pytest.raises(PolicyError, match="firsts must be"):
        policy.reset(counts, np.zeros((3, 4)))


def test_request_counts_count_each_request_once():
    first = np.zeros((3, 2, 4))
    first[:, 0, 1] = 1.0  # three tokens of one request
    first[1, 1, 2] = 2.0
    second = np.zeros((2, 2, 4))
    second[0, 0, 1] = 1.0
    expected = np.zeros((2, 4))
    expected[0, 1], expected[1, 2] = 2, 1
    np.testing.assert_array_equal(request_counts([first, second]), expected)


def test_make_eviction_fitted_refits_online_from_what_it_serves():
    """Without a fit the policy starts from the fixed constants, logs the accesses it is told of and,
    after `every` finished sequences, refits its own cache size in the background."""
    policy = make_eviction("fitted", 5, 12, top_k=2.0)
    assert isinstance(policy, FittedEviction) and policy.online is not None
    policy.online.every = 3
    traces = workload(8, seed=5)
    capacity = max(int(np.count_nonzero(t, axis=2).max()) for t in traces) + 8
    policy.set_capacity(capacity)
    simulate(traces, capacity, policy, make_prefetch("none", 5, 12))  # the Python replay: runtime calls
    policy.online.wait(60)
    assert policy.online.refits >= 1
    assert len(policy.online._sequences) >= 3
    logged = policy.online._sequences[0]
    assert logged.shape[1:] == (5, 12)
    # the first sequence's steps are recovered from the layer order (its end is known only at the next
    # eviction decision, which may come a few visits into the next sequence)
    np.testing.assert_array_equal(logged[:3], np.minimum(traces[0][:3], 1))
    assert policy.top_k == 2.0  # the model's, as the runtime passes it
    for name, values in GRID.items():  # each constant is a grid point (or the fixed one it started from)
        assert getattr(policy.setting, name) in (*values, getattr(FIXED, name))


@pytest.mark.parametrize("setting", [Setting(shape=1.0, follow=0.5, carry=0.1, first_use=8.0),
                                     Setting(shape=0.3, mix=0.5, slow=0.995)])
def test_a_float32_eam_takes_the_decisions_of_its_float64_copy(setting):
    """The runtime hands float32 counts, read without a copy: every decision over growing sequences (and a
    new one, where counts shrink) is the one the float64 copy takes, and the state is the same."""
    traces = workload(3, seed=5)
    policies = {dtype: FittedEviction(5, 12, top_k=2.0) for dtype in (np.float32, np.float64)}
    rng = np.random.default_rng(0)
    for policy in policies.values():
        policy.use(setting)
        for index in rng.permutation(60)[:40]:
            policy.on_insert(policy.key(int(index)))
        rng = np.random.default_rng(0)
    decided = 0
    for trace in traces:
        eam = np.zeros(trace.shape[1:])
        for step in trace:
            for layer in range(trace.shape[1]):
                eam[layer] += step[layer]
                picks = {dtype: policy.victims(EvictionContext(cur_eam=eam.astype(dtype), layer=layer), 3)
                         for dtype, policy in policies.items()}
                assert picks[np.float32] == picks[np.float64]
                decided += 1
    assert decided > 50
    for name in ("running", "layer_state", "count", "transition"):
        np.testing.assert_array_equal(getattr(policies[np.float32], name),
                                      getattr(policies[np.float64], name))
