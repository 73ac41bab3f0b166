from __future__ import annotations

import threading

import numpy as np
import pytest

from moeinf.trace.eamc import EAMC
from moeinf.trace.online import OnlineEAMC
from moeinf.trace.synthetic import Workload

L, E = 8, 32


@pytest.fixture(scope="module")
def workloads() -> tuple[np.ndarray, np.ndarray]:
    before = Workload.make(L, E, top_k=2, tasks=6, seed=1).sample(150, tokens=24, seed=3)[0]
    after = Workload.make(L, E, top_k=2, tasks=6, seed=2).sample(60, tokens=24, seed=4)[0]
    return before, after


def run(online: OnlineEAMC, eams: np.ndarray) -> float:
    """Serve each sequence with the EAMC current at its start; report it; mean accuracy."""
    scores = []
    for eam in eams:
        _, predicted = online.current.match(eam)
        scores.append(online.report(eam, predicted))
    return float(np.mean(scores))


def test_distribution_shift_recovers_after_rebuild(workloads) -> None:
    before, after = workloads
    online = OnlineEAMC(EAMC.build(before, 24), threshold=0.5, rebuild_after=12)
    assert run(online, before[:30]) > 0.75
    assert online.pending == 0
    shifted = run(online, after[:12])
    assert shifted < 0.4
    assert online.wait(timeout=60)
    assert online.rebuilds == 1 and online.current.capacity == 24
    assert online.current.meta["online_rebuilds"] == 1
    assert run(online, after[12:]) > 0.75  # the new workload is predicted as well as the old one was
    assert run(online, before[30:60]) > 0.6  # and the old one is not forgotten


def test_matching_never_blocks_during_a_slow_rebuild(workloads) -> None:
    before, after = workloads
    started, release = threading.Event(), threading.Event()

    def slow_builder(eams: np.ndarray, capacity: int, seed: int) -> EAMC:
        started.set()
        assert release.wait(timeout=60)
        return EAMC.build(eams, capacity, seed=seed)

    first = EAMC.build(before, 16)
    online = OnlineEAMC(first, threshold=0.5, rebuild_after=4, builder=slow_builder)
    run(online, after[:4])
    assert started.wait(timeout=60) and online.rebuilding
    for eam in after[4:20]:  # readers and reporters carry on against the old EAMC
        assert online.current is first
        online.current.match(eam, 3)
        online.report(eam, online.current.match(eam)[1])
    assert online.pending == 16 and online.current is first
    release.set()
    assert online.wait(timeout=60)
    assert online.current is not first and online.rebuilds == 1


def test_failed_rebuild_is_reraised(workloads) -> None:
    before, after = workloads

    def broken(eams: np.ndarray, capacity: int, seed: int) -> EAMC:
        raise OSError("disk full")

    online = OnlineEAMC(EAMC.build(before, 8), threshold=0.5, rebuild_after=2, builder=broken)
    run(online, after[:2])
    with pytest.raises(RuntimeError, match="rebuild failed") as info:
        online.wait(timeout=60)
    assert isinstance(info.value.__cause__, OSError)
    assert online.rebuilds == 0


def test_rebuild_after_zero_disables(workloads) -> None:
    before, after = workloads
    online = OnlineEAMC(EAMC.build(before, 8), threshold=0.5, rebuild_after=0)
    assert run(online, after[:5]) < 0.5
    assert online.pending == 0 and not online.rebuilding


def test_rejects_bad_knobs(workloads) -> None:
    eamc = EAMC.build(workloads[0], 4)
    with pytest.raises(ValueError, match="online_threshold"):
        OnlineEAMC(eamc, threshold=1.5)
    with pytest.raises(ValueError, match="online_rebuild_after"):
        OnlineEAMC(eamc, rebuild_after=-1)


def test_grows_to_capacity_then_rebuilds_at_capacity(workloads) -> None:
    before, after = workloads
    online = OnlineEAMC(EAMC(before[:1]), threshold=0.5, rebuild_after=4, capacity=20)
    seen = [online.current.capacity]
    for eam in before[1:40]:
        online.report(eam, online.current.match(eam)[1])
        seen.append(online.current.capacity)
    assert seen[:20] == list(range(1, 21))  # every finished sequence joins until the capacity is reached
    assert seen[-1] == 20 and online.rebuilds == 0
    assert np.array_equal(online.current.eams[5], before[5])
    run(online, after[:4])  # full: poorly predicted sequences now trigger a rebuild of the same size
    assert online.wait(timeout=60)
    assert online.rebuilds == 1 and online.current.capacity == 20


def test_add_without_prediction_grows_until_full(workloads) -> None:
    before, _ = workloads
    online = OnlineEAMC(EAMC(before[:2]), capacity=3)
    assert online.add(before[2]) and online.current.capacity == 3
    assert not online.add(before[3]) and online.current.capacity == 3
    with pytest.raises(ValueError, match="eamc_capacity"):
        OnlineEAMC(EAMC(before[:2]), capacity=0)
