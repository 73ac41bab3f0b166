from __future__ import annotations

import numpy as np
import pytest

from moeinf.trace.eam import (
    accuracy,
    add_tokens,
    distance,
    empty_eam,
    flat_unit_rows,
    layer_mask,
    normalize_rows,
    similarity,
    sum_normalize_rows,
)


def eq1_by_definition(a: np.ndarray, b: np.ndarray, layers: list[int]) -> float:
    """Eq. 1 written out with sum-normalised rows and explicit cosines."""
    total = 0.0
    for layer in layers:
        x, y = a[layer].astype(np.float64), b[layer].astype(np.float64)
        if x.sum() == 0 or y.sum() == 0:
            continue
        x, y = x / x.sum(), y / y.sum()
        total += float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))
    return 1.0 - total / len(layers)


def random_eam(rng: np.random.Generator, layers: int = 5, experts: int = 8) -> np.ndarray:
    return rng.integers(0, 4, size=(layers, experts)).astype(np.float32)


def test_distance_matches_eq1_on_all_and_partial_layers() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        a, b = random_eam(rng), random_eam(rng)
        assert distance(a, b) == pytest.approx(eq1_by_definition(a, b, list(range(5))), abs=1e-6)
        assert distance(a, b, 3) == pytest.approx(eq1_by_definition(a, b, [0, 1, 2]), abs=1e-6)
        mask = np.array([True, False, True, False, True])
        assert distance(a, b, mask) == pytest.approx(eq1_by_definition(a, b, [0, 2, 4]), abs=1e-6)


def test_distance_properties() -> None:
    a = np.array([[1, 0, 3], [0, 2, 0]], dtype=np.float32)
    assert distance(a, a) == pytest.approx(0.0, abs=1e-6)
    assert distance(a, 5 * a) == pytest.approx(0.0, abs=1e-6)  # scale-invariant per row
    b = np.array([[0, 1, 0], [1, 0, 1]], dtype=np.float32)
    assert distance(a, b) == pytest.approx(1.0)  # disjoint experts in every layer
    assert distance(a, b, 0) == 1.0  # nothing observed: nothing known in common


def test_empty_row_contributes_zero_similarity() -> None:
    a = np.array([[1, 1], [0, 0]], dtype=np.float32)
    b = np.array([[1, 1], [1, 0]], dtype=np.float32)
    assert similarity(a, b) == pytest.approx(0.5)
    assert np.all(normalize_rows(a)[1] == 0)
    assert np.all(sum_normalize_rows(a)[1] == 0)


def test_flat_unit_rows_dot_is_layer_sum_of_cosines() -> None:
    rng = np.random.default_rng(1)
    a, b = random_eam(rng), random_eam(rng)
    u = flat_unit_rows(np.stack([a, b]))
    assert u.shape == (2, 40)
    assert float(u[0] @ u[1]) / 5 == pytest.approx(similarity(a, b), abs=1e-6)


def test_add_tokens_counts_and_skips_dropped() -> None:
    eam = empty_eam(2, 4)
    add_tokens(eam, 1, np.array([[0, 3], [3, -1]]))
    assert eam.tolist() == [[0, 0, 0, 0], [1, 0, 0, 2]]


def test_layer_mask_validation() -> None:
    assert layer_mask(3, 2).tolist() == [True, True, False]
    with pytest.raises(ValueError, match="observed layers"):
        layer_mask(3, 4)
    with pytest.raises(ValueError, match="boolean"):
        layer_mask(3, np.array([1, 0, 1]))


def test_accuracy_topk_of_predicted_vs_activated() -> None:
    actual = np.array([[2, 1, 0, 0], [0, 0, 5, 0]], dtype=np.float32)  # A_0 = {0, 1}, A_1 = {2}
    predicted = np.array([[9, 0, 4, 1], [0, 0, 1, 0]], dtype=np.float32)  # P_0 = {0, 2}, P_1 = {2}
    assert accuracy(actual, predicted) == pytest.approx(2 / 3)
    assert accuracy(actual, predicted, 1) == pytest.approx(1 / 2)
    assert accuracy(actual, actual) == 1.0
    assert accuracy(actual, np.zeros_like(actual)) == 0.0  # predicting nothing foresees nothing
    assert accuracy(np.zeros_like(actual), predicted) == 1.0


def test_accuracy_ties_go_to_lower_expert() -> None:
    actual = np.array([[0, 1, 0]], dtype=np.float32)
    assert accuracy(actual, np.array([[1, 1, 0]], dtype=np.float32)) == 0.0
    assert accuracy(actual, np.array([[0, 1, 1]], dtype=np.float32)) == 1.0


@pytest.mark.parametrize("mask", [None, [[1, 1]], [[1, 0]]])
def test_a_lone_tokens_ids_count_as_the_batch_path_counts_them(mask) -> None:
    """`Offloader._record` with a decoded row's expert ids (`Dispatch.ids`) adds what the numpy path adds
    for the same routing: its distinct ids, nothing for a dropped (-1) slot or a padded position."""
    import numpy as np
    import torch

    from moeinf.kernels.moe import Dispatch
    from moeinf.runtime.offloader import Batch, Offloader

    def recorded(with_ids: bool) -> np.ndarray:
        offloader = Offloader.__new__(Offloader)  # only `_record`'s state
        offloader.num_experts, offloader.num_layers = 8, 2
        offloader.lookahead = None  # no look-ahead to note the routing for
        offloader.batch = Batch(np.zeros((1, 2, 8), dtype=np.float32))
        if mask is not None:
            offloader.batch.real = np.array(mask) != 0
        for layer, index in enumerate(([[3, 5, 1]], [[-1, 7, 2]])):
            top_k_index = torch.tensor(index)
            ids = Dispatch(top_k_index, 8).ids if with_ids else None
            assert (ids is not None) == with_ids
            offloader._record(layer, top_k_index, ids)
        return offloader.batch.eams

    assert np.array_equal(recorded(True), recorded(False))
    assert recorded(True).sum() == (0 if mask == [[1, 0]] else 5)
