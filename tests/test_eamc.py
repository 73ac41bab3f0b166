from __future__ import annotations

import json

import numpy as np
import pytest

from moeinf.trace.eam import distance, flat_unit_rows
from moeinf.trace.eamc import EAMC, EAMCMismatchError, kmeans_medoids
from moeinf.trace.matcher import Matcher
from moeinf.trace.synthetic import Workload

L, E = 6, 16


@pytest.fixture(scope="module")
def eams() -> np.ndarray:
    out, _ = Workload.make(L, E, top_k=2, tasks=5, seed=3).sample(120, tokens=24, seed=4)
    return out


def pairwise_eq1(eams: np.ndarray) -> np.ndarray:
    """Eq. 1 for every pair, written out: sum-normalised rows, per-layer cosines, mean over layers."""
    shares = eams / eams.sum(axis=-1, keepdims=True)  # every row has tokens here
    cos = np.einsum("ile,jle->ijl", shares, shares) / np.einsum(
        "il,jl->ijl", np.linalg.norm(shares, axis=-1), np.linalg.norm(shares, axis=-1))
    return 1.0 - cos.mean(axis=-1)


def test_pairwise_helper_agrees_with_distance(eams: np.ndarray) -> None:
    d = pairwise_eq1(eams[:6])
    for i in range(6):
        for j in range(6):
            assert d[i, j] == pytest.approx(distance(eams[i], eams[j]), abs=1e-5)


def test_kmeans_objective_is_eq1_pairwise_sum(eams: np.ndarray) -> None:
    from sklearn.cluster import KMeans

    points = flat_unit_rows(eams)
    km = KMeans(n_clusters=7, n_init=1, random_state=0).fit(points)
    d = pairwise_eq1(eams)
    by_eq1 = sum(L / np.sum(km.labels_ == c) * d[np.ix_(km.labels_ == c, km.labels_ == c)].sum()
                 for c in range(7))
    assert km.inertia_ == pytest.approx(by_eq1, rel=1e-4)


def test_kept_entry_is_the_eq1_medoid_of_its_cluster(eams: np.ndarray) -> None:
    from sklearn.cluster import KMeans

    points = flat_unit_rows(eams)
    keep = kmeans_medoids(points, 7, seed=0)
    labels = KMeans(n_clusters=7, n_init=1, random_state=0).fit(points).labels_
    d = pairwise_eq1(eams)
    for cluster, kept in enumerate(keep):
        members = np.flatnonzero(labels == cluster)
        assert labels[kept] == cluster
        totals = d[np.ix_(members, members)].sum(axis=1)
        assert totals[list(members).index(kept)] == pytest.approx(totals.min(), abs=1e-4)


def test_build_keeps_real_eams(eams: np.ndarray) -> None:
    eamc = EAMC.build(eams, 10, seed=1)
    assert eamc.eams.shape == (10, L, E)
    for entry in eamc.eams:
        assert any(np.array_equal(entry, e) for e in eams)
    assert eamc.meta["capacity"] == 10 and eamc.meta["num_sequences"] == 120


def test_build_refuses_capacity_above_distinct_eams(eams: np.ndarray) -> None:
    doubled = np.concatenate([eams[:5], eams[:5]])
    with pytest.raises(ValueError, match="lower --capacity"):
        EAMC.build(doubled, 6)
    assert len(EAMC.build(doubled, 5)) == 5


def test_match_is_nearest_by_eq1_at_every_depth(eams: np.ndarray) -> None:
    eamc = EAMC.build(eams, 12)
    rng = np.random.default_rng(0)
    for query in eams[rng.choice(len(eams), 15, replace=False)]:
        for depth in (1, 3, L):
            index, entry = eamc.match(query, depth)
            dists = [distance(query, e, depth) for e in eamc.eams]
            assert dists[index] == pytest.approx(min(dists), abs=1e-6)
            assert entry is eamc.eams[index] or np.array_equal(entry, eamc.eams[index])
            assert eamc.similarities(query, depth)[index] == pytest.approx(1 - min(dists), abs=1e-5)
        mask = np.zeros(L, dtype=bool)
        mask[[1, 4]] = True
        index, _ = eamc.match(query, mask)
        dists = [distance(query, e, mask) for e in eamc.eams]
        assert dists[index] == pytest.approx(min(dists), abs=1e-6)


def test_match_of_a_member_is_itself(eams: np.ndarray) -> None:
    eamc = EAMC.build(eams, 12)
    for i, entry in enumerate(eamc.eams):
        assert eamc.match(entry.copy())[0] == i


def test_matcher_equals_match(eams: np.ndarray) -> None:
    eamc = EAMC.build(eams, 12)
    matcher = Matcher(eamc)
    query = eams[7]
    for depth in range(1, L + 1):
        matcher.update(depth - 1, query[depth - 1])
        assert matcher.match(depth)[0] == eamc.match(query, depth)[0]
    matcher.reset()
    matcher.update_all(eams[8])
    assert matcher.match()[0] == eamc.match(eams[8])[0]
    np.testing.assert_allclose(matcher.similarities(3), eamc.similarities(eams[8], 3), atol=1e-5)


def test_matcher_token_by_token_equals_match() -> None:
    workload = Workload.make(L, E, top_k=2, tasks=5, seed=3)
    eamc = EAMC.build(workload.sample(60, tokens=24, seed=4)[0], 10)
    matcher = Matcher(eamc)
    running = np.zeros((L, E), dtype=np.float32)
    rng = np.random.default_rng(5)
    for layer in range(L):  # the prefill: 20 tokens at once, some dropped (-1)
        ids = rng.integers(-1, E, size=(20, 2))
        matcher.add(layer, ids)
        running[layer] += np.bincount(ids[ids >= 0], minlength=E)
        assert matcher.match(layer + 1)[0] == eamc.match(running, layer + 1)[0]
    for _ in range(30):  # decode steps: each layer gets one token routed to 2 experts (or dropped: -1)
        for layer in range(L):
            ids = rng.choice(np.arange(-1, E), size=2, replace=False, p=np.r_[0.02, np.full(E, 0.98 / E)])
            matcher.add(layer, ids)
            running[layer, ids[ids >= 0]] += 1
            assert matcher.match(layer + 1)[0] == eamc.match(running, layer + 1)[0]
    np.testing.assert_array_equal(matcher.counts, running)
    np.testing.assert_allclose(matcher.similarities(), eamc.similarities(running), atol=1e-5)
    matcher.update(0, np.zeros(E, dtype=np.float32))  # an emptied row contributes nothing
    running[0] = 0
    np.testing.assert_allclose(matcher.similarities(), eamc.similarities(running), atol=1e-5)


def test_match_validates_shape(eams: np.ndarray) -> None:
    eamc = EAMC.build(eams, 4)
    with pytest.raises(ValueError, match=r"\[6, 16\]"):
        eamc.match(np.zeros((L, E + 1), dtype=np.float32), 1)


def test_save_load_roundtrip_and_fingerprint(tmp_path, eams: np.ndarray) -> None:
    eamc = EAMC.build(eams, 8, seed=2)
    path = eamc.save(tmp_path / "x.eamc", {"fingerprint": "abc", "top_k": 2, "datasets": ["a.jsonl"]})
    loaded = EAMC.load(path, fingerprint="abc")
    assert np.array_equal(loaded.eams, eamc.eams)
    assert loaded.meta["top_k"] == 2 and loaded.meta["seed"] == 2 and loaded.meta["num_layers"] == L
    assert EAMC.load(path).meta["fingerprint"] == "abc"
    with pytest.raises(EAMCMismatchError, match="'abc'.*'xyz'.*moeinf trace"):
        EAMC.load(path, fingerprint="xyz")


def test_load_rejects_foreign_file(tmp_path) -> None:
    from safetensors.numpy import save_file

    save_file({"eams": np.zeros((1, 2, 2), np.float32)}, str(tmp_path / "a"),
              metadata={"moeinf": json.dumps({"format": "other", "version": 1})})
    with pytest.raises(ValueError, match="unsupported EAMC format"):
        EAMC.load(tmp_path / "a")
    save_file({"w": np.zeros(1, np.float32)}, str(tmp_path / "b"))
    with pytest.raises(ValueError, match="not a moeinf EAMC"):
        EAMC.load(tmp_path / "b")
