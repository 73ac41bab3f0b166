"""`moeinf bench prefetch --model`: slot recall/precision of every predictor, measured live."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moeinf import zoo
from moeinf.bench import prefetch_live


@pytest.fixture(scope="module")
def tiny_zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return zoo.get_model("tiny", cache_dir=tmp_path_factory.mktemp("zoo-cache"), threads=1, progress=False)


def test_prefix_counts_see_only_earlier_tokens_of_the_same_sequence() -> None:
    ids = np.array([[[0]], [[1]], [[1]], [[0]], [[2]]])  # [N=5, L=1, k=1]
    sequence = np.array([0, 0, 0, 1, 1])
    counts = prefetch_live.prefix_counts(ids, sequence, 3)[:, 0]  # [N, E]
    assert counts.shape == (5, 3)
    np.testing.assert_array_equal(counts, [[0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 0, 0], [1, 0, 0]])


def test_shares_scale_by_top_k_and_cap_at_one() -> None:
    np.testing.assert_allclose(prefetch_live.shares(np.array([[3.0, 1.0, 0.0], [0.0, 0.0, 0.0]]), 2),
                               [[1.0, 0.5, 0.0], [0.0, 0.0, 0.0]])


def test_live_measurement_gives_every_predictor_and_depth(tiny_zoo: Path) -> None:
    rows, header = prefetch_live.measure(tiny_zoo, train_prompts=4, test_prompts=2, new_tokens=4, depth=1,
                                         threshold=0.5, max_prompt_tokens=32, seed=0)
    names = [r["predictor"] for r in rows]
    assert names == ["none", "topk", "traced-topk", "activation-aware", "lookahead-router",
                     "lookahead-learned", "router+learned", "hybrid", "next token: lookahead-learned",
                     "next token: traced-topk"]
    assert all(r["depth"] == 1 for r in rows)
    assert rows[0]["recall"] == 0.0
    for r in rows[1:]:
        assert 0.0 < r["recall"] <= 1.0 and 0.0 < r["precision"] <= 1.0
    # The tiny model has 2 MoE layers: depth 1 is layer 0 -> 1 for every token of the test prompts.
    assert header["test_tokens"] > 0 and header["num_layers"] == 2
    table = prefetch_live.table(rows, header)
    assert "hybrid" in table and "next token: lookahead-learned" in table
