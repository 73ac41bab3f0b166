"""The expert activation matrix (EAM) of one sequence and the Eq. 1 distance between two of them.

An EAM is a float32 numpy array `[L, E]`: `eam[l, e]` is the number of tokens of the sequence (prompt and
generated so far) that the router of MoE layer `l` sent to expert `e`.

Eq. 1 of the MoE-Infinity paper compares two EAMs layer by layer:

    d(M1, M2) = 1 - (1/L) * sum_l cos(M1[l] / sum(M1[l]), M2[l] / sum(M2[l]))

Cosine ignores scale, so each row can be L2-normalised instead of sum-normalised, and the mean of the
row cosines is `<u1, u2> / L` where `u` concatenates the unit rows (`flat_unit_rows`). A row without
tokens has no direction: it is left at zero and contributes 0 similarity. During a forward pass only the
layers observed so far are compared: `layers` selects them and the mean runs over those layers only.
"""

from __future__ import annotations

import numpy as np

LayerSelection = int | np.ndarray | None
"""Which layers count: None = all, an int `l` = the leading `l` layers, or a boolean mask of length L."""


def empty_eam(num_layers: int, num_experts: int) -> np.ndarray:
    """A zero EAM `[L, E]` (float32)."""
    return np.zeros((num_layers, num_experts), dtype=np.float32)


def add_tokens(eam: np.ndarray, layer: int, expert_ids: np.ndarray) -> None:
    """Count, in place, one token per entry of `expert_ids` (any shape) at MoE layer `layer`.

    Negative ids mean "no expert" (a token dropped by a capacity-limited router) and are not counted.
    """
    ids = np.asarray(expert_ids).reshape(-1)
    ids = ids[ids >= 0]
    eam[layer] += np.bincount(ids, minlength=eam.shape[1]).astype(np.float32)


def layer_mask(num_layers: int, layers: LayerSelection) -> np.ndarray:
    """The boolean mask `[L]` of the layers that count (see `LayerSelection`)."""
    if layers is None:
        return np.ones(num_layers, dtype=bool)
    if isinstance(layers, (int, np.integer)):
        if not 0 <= int(layers) <= num_layers:
            raise ValueError(f"observed layers must lie in [0, {num_layers}], got {layers}")
        mask = np.zeros(num_layers, dtype=bool)
        mask[: int(layers)] = True
        return mask
    mask = np.asarray(layers)
    if mask.dtype != bool or mask.shape != (num_layers,):
        raise ValueError(f"a layer mask must be a boolean array of shape ({num_layers},), "
                         f"got dtype {mask.dtype} and shape {mask.shape}")
    return mask


def normalize_rows(eam: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (float32); rows without tokens stay zero. Works on `[..., L, E]`."""
    eam = np.asarray(eam, dtype=np.float32)
    norms = np.linalg.norm(eam, axis=-1, keepdims=True)
    return np.divide(eam, norms, out=np.zeros_like(eam), where=norms > 0)


def sum_normalize_rows(eam: np.ndarray) -> np.ndarray:
    """Rows scaled to sum 1 (the per-layer activation share used by Algorithms 1 and 2); empty rows stay 0."""
    eam = np.asarray(eam, dtype=np.float32)
    sums = eam.sum(axis=-1, keepdims=True)
    return np.divide(eam, sums, out=np.zeros_like(eam), where=sums > 0)


def flat_unit_rows(eams: np.ndarray) -> np.ndarray:
    """`[N, L, E]` (or one `[L, E]`) -> `[N, L*E]` concatenated unit rows, where K-Means is Eq. 1."""
    eams = np.asarray(eams, dtype=np.float32)
    if eams.ndim == 2:
        eams = eams[None]
    n, num_layers, num_experts = eams.shape
    return np.ascontiguousarray(normalize_rows(eams).reshape(n, num_layers * num_experts))


def similarity(a: np.ndarray, b: np.ndarray, layers: LayerSelection = None) -> float:
    """Mean over the selected layers of the row cosines of `a` and `b` (`1 - distance`)."""
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"EAMs must both be [L, E] of the same shape, got {a.shape} and {b.shape}")
    mask = layer_mask(a.shape[0], layers)
    count = int(mask.sum())
    if count == 0:
        return 0.0
    cos = (normalize_rows(a[mask]) * normalize_rows(b[mask])).sum(axis=-1)
    return float(cos.sum() / count)


def distance(a: np.ndarray, b: np.ndarray, layers: LayerSelection = None) -> float:
    """Eq. 1 distance between two EAMs, over the selected layers only (all by default).

    With no layer selected the distance is 1 (nothing in common is known).
    """
    return 1.0 - similarity(a, b, layers)


def accuracy(actual: np.ndarray, predicted: np.ndarray, layers: LayerSelection = None) -> float:
    """How well `predicted` foresaw the experts that `actual` activated, in [0, 1].

    Per selected layer `l`, let `A_l` be the experts with at least one token in `actual[l]` and `P_l` the
    `|A_l|` experts with the most tokens in `predicted[l]` (ties to the lower expert id; experts with no
    token in `predicted[l]` are never predicted, so `P_l` may be smaller). The accuracy is
    `sum_l |A_l & P_l| / sum_l |A_l|`: the share of the sequence's activations that a prefetcher
    fetching as many experts as were needed, in the predicted order, would have had ready.
    A sequence that activated nothing has accuracy 1 (there was nothing to predict).
    """
    if actual.shape != predicted.shape or actual.ndim != 2:
        raise ValueError(f"EAMs must both be [L, E] of the same shape, got {actual.shape} and "
                         f"{predicted.shape}")
    mask = layer_mask(actual.shape[0], layers)
    act = np.asarray(actual, dtype=np.float32)[mask] > 0  # [l, E]
    pred = np.asarray(predicted, dtype=np.float32)[mask]
    need = act.sum(axis=1)  # [l] |A_l|
    total = int(need.sum())
    if total == 0:
        return 1.0
    # Stable descending order: negate so that argsort's stable ascending sort keeps lower ids first on ties.
    order = np.argsort(-pred, axis=1, kind="stable")  # [l, E]
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(pred.shape[1])[None, :].repeat(pred.shape[0], 0), axis=1)
    chosen = (rank < need[:, None]) & (pred > 0)
    return float((chosen & act).sum() / total)
