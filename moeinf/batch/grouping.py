"""Route-aware grouping of prompts into batches (ExpertFlow's token scheduling, with MoE-Infinity's EAMs).

A decode step of a batch reads every distinct expert its rows route to that is not cached. Rows whose
routing is alike share experts, so batches of alike prompts touch fewer experts per step. Each prompt's
routing is taken from a cheap first pass: the prompts run up to the router of the first MoE layer only
(its experts are never read or computed: the pass stops in a pre-hook of the first experts module), which
gives each prompt's first-layer EAM row. With an EAMC the partial EAM is matched (Eq. 1 over the
observed layer) and the matched entry stands for the prompt's whole EAM.

The signatures (L2-normalised EAM rows, concatenated) are clustered by spherical K-Means into as many
clusters as there are batches; clusters are chained greedily by centroid similarity and each is sorted
by prompt length (less padding), then the order is cut into batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .jobs import Id, Prompt
from .runner import pad_batch, pad_id_of

ORDERS = ("arrival", "length", "route")
PASS_ROWS = 32
"""Prompts per routing pass."""


class _Stop(Exception):
    """Raised by the pre-hook of the first experts module to end a routing pass."""


def first_layer_eams(forward: Callable[..., Any], model: torch.nn.Module, rows: Sequence[Sequence[int]],
                     pad_id: int) -> np.ndarray:
    """[n, L, E] EAMs of `rows` (token lists) with only the first MoE layer filled: each pass of
    `forward(input_ids, attention_mask=...)` stops at the first experts module, before any expert runs."""
    from moeinf.trace.router import RouterTracer

    out = []
    with RouterTracer(model) as tracer:
        first = dict(model.named_modules())[tracer.module_names[0]]

        def stop(*_: object, **__: object) -> None:
            raise _Stop

        handle = first.register_forward_pre_hook(stop)  # after the tracer's own hook: it records first
        try:
            for start in range(0, len(rows), PASS_ROWS):
                ids, mask = pad_batch(rows[start:start + PASS_ROWS], pad_id)
                tracer.reset()
                try:
                    with torch.inference_mode():
                        forward(ids, attention_mask=mask, use_cache=False)
                except _Stop:
                    pass
                out.append(tracer.eams())
        finally:
            handle.remove()
            # each pass began sequences in the runtime (`MoE.__call__`) that it stopped: none is running
            # (their EAMs are empty: no expert layer ran), so a running batch opened next starts from none
            keep_rows = getattr(forward, "keep_rows", None)
            if keep_rows is not None:
                keep_rows([])
    return np.concatenate(out)


def signatures(eams: np.ndarray, eamc: Any | None = None) -> np.ndarray:
    """[n, D] unit vectors of prompt routing: the first-layer rows, or the matched EAMC entries."""
    if eamc is not None:
        eams = np.stack([eamc.match(e, 1)[1] for e in eams])
    rows = eams.astype(np.float64)
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    rows = np.divide(rows, norms, out=np.zeros_like(rows), where=norms > 0)
    flat = rows.reshape(len(rows), -1)
    total = np.linalg.norm(flat, axis=1, keepdims=True)
    return np.divide(flat, total, out=np.zeros_like(flat), where=total > 0)


def spherical_kmeans(points: np.ndarray, k: int, *, seed: int = 0, iterations: int = 20) -> np.ndarray:
    """Cluster labels [n] of unit vectors `points` [n, D] by cosine (k-means++ seeding)."""
    n = len(points)
    k = max(1, min(k, n))
    rng = np.random.default_rng(seed)
    centres = [points[rng.integers(n)]]
    for _ in range(1, k):
        distance = 1.0 - np.max(points @ np.stack(centres).T, axis=1)
        weights = np.clip(distance, 0, None)
        centres.append(points[rng.choice(n, p=weights / weights.sum())] if weights.sum() > 0
                       else points[rng.integers(n)])
    c = np.stack(centres)
    labels = np.zeros(n, dtype=np.int64)
    for _ in range(iterations):
        new = np.argmax(points @ c.T, axis=1)
        if _ > 0 and np.array_equal(new, labels):
            break
        labels = new
        for j in range(k):
            members = points[labels == j]
            if len(members):
                mean = members.sum(axis=0)
                norm = np.linalg.norm(mean)
                c[j] = mean / norm if norm > 0 else c[j]
    return labels


def route_order(signature: np.ndarray, lengths: Sequence[int], batch_size: int, *,
                seed: int = 0) -> list[int]:
    """Indices of the prompts in route-aware order (see the module docstring)."""
    n = len(signature)
    labels = spherical_kmeans(signature, math.ceil(n / batch_size), seed=seed)
    clusters = [np.flatnonzero(labels == j) for j in np.unique(labels)]
    centres = np.stack([signature[c].mean(axis=0) for c in clusters])
    left = list(range(len(clusters)))
    current = max(left, key=lambda j: len(clusters[j]))
    chain = []
    while left:
        left.remove(current)
        chain.append(current)
        if left:
            current = max(left, key=lambda j: float(centres[current] @ centres[j]))
    order: list[int] = []
    for j in chain:
        order.extend(sorted(clusters[j].tolist(), key=lambda i: (lengths[i], i)))
    return order


def order_prompts(prompts: Sequence[Prompt], order: str, *, lengths: Mapping[Id, int], batch_size: int,
                  model: Any = None, tokenizer: Any = None, eamc: Any = None) -> list[Prompt]:
    """`prompts` in the order batches take them: `arrival` (as given), `length` (shortest first: less
    padding) or `route` (needs `model`, a `moeinf.MoE`, for the routing pass)."""
    if order == "arrival":
        return list(prompts)
    if order == "length":
        return sorted(prompts, key=lambda p: lengths[p.id])
    if order != "route":
        raise ValueError(f"order must be one of {ORDERS}, not {order!r}")
    if len(prompts) <= batch_size:
        return sorted(prompts, key=lambda p: lengths[p.id])
    tokenizer = tokenizer or model.tokenizer
    rows = [tokenizer.encode(p.prompt) for p in prompts]
    if eamc is None and getattr(model, "config", None) is not None and getattr(model.config, "eamc", None):
        from moeinf.trace.eamc import EAMC

        eamc = EAMC.load(model.config.eamc)
    eams = first_layer_eams(model, model.model, rows, pad_id_of(tokenizer, model.model.config))
    index = route_order(signatures(eams, eamc), [len(r) for r in rows], batch_size)
    return [prompts[i] for i in index]
