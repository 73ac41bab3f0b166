"""The expert activation matrix collection (EAMC): a few hundred real EAMs that stand for a workload.

Build: K-Means with k = capacity over the EAMs of a trace, in the space of concatenated L2-normalised rows
(`eam.flat_unit_rows`). When every row of the EAMs has tokens, each such vector has squared norm L, so
`||u1 - u2||^2 = 2L * d(M1, M2)` (Eq. 1) and the K-Means objective of a cluster C equals
`(L / |C|) * sum_{i, j in C} d(M_i, M_j)`: scikit-learn's Euclidean K-Means on these vectors is K-Means
under Eq. 1. Per cluster the EAMC keeps the real EAM closest to the centroid, which by the same identity
is the cluster's Eq. 1 medoid (the member with the least total distance to the others).

Match: the entry nearest to a partial EAM over the layers observed so far is the one with the largest
dot product between its unit rows and the partial EAM's unit rows: one matrix-vector product over
rows precomputed at load time. The runtime, which sees a few more tokens per layer at a time, uses the
incremental `matcher.Matcher` instead.

File: safetensors with the `[P, L, E]` matrix under "eams" and JSON metadata under "moeinf" (see
`EAMC.save`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .eam import LayerSelection, flat_unit_rows, layer_mask, normalize_rows

log = logging.getLogger(__name__)

FORMAT = "moeinf-eamc"
VERSION = 1


class EAMCMismatchError(ValueError):
    """An EAMC file was traced on another model than the one it is used with."""


class EAMC:
    """An immutable collection of P real EAMs `[P, L, E]` with precomputed unit rows for matching.

    `meta` is free-form JSON-able metadata (see `save`). Instances are never modified after construction,
    so several threads may match against one while another builds its replacement.
    """

    def __init__(self, eams: np.ndarray, meta: Mapping[str, Any] | None = None) -> None:
        eams = np.ascontiguousarray(eams, dtype=np.float32)
        if eams.ndim != 3 or eams.shape[0] == 0:
            raise ValueError(f"an EAMC holds [P, L, E] EAMs with P >= 1, got shape {eams.shape}")
        self.eams = eams
        self.eams.setflags(write=False)
        self.meta: dict[str, Any] = dict(meta or {})
        self.capacity, self.num_layers, self.num_experts = eams.shape
        self._flat = flat_unit_rows(eams)  # [P, L*E]; a leading slice [:, :l*E] is the first l layers
        self.unit_columns = np.ascontiguousarray(
            self._flat.reshape(self.capacity, self.num_layers, -1).transpose(1, 2, 0))
        """[L, E, P]: entry p's unit row l, stored by expert, so that `Matcher` reads one contiguous
        [P] vector per expert whose count changed."""

    def __len__(self) -> int:
        return self.capacity

    def __repr__(self) -> str:
        return f"EAMC(capacity={self.capacity}, layers={self.num_layers}, experts={self.num_experts})"

    @classmethod
    def build(cls, eams: np.ndarray, capacity: int, *, seed: int = 0, n_init: int = 1,
              meta: Mapping[str, Any] | None = None) -> EAMC:
        """K-Means (Eq. 1) with k = `capacity` over `eams` `[N, L, E]`; keeps each cluster's medoid.

        Raises ValueError when `capacity` exceeds the number of distinct EAMs: there would be clusters
        without a member (lower the capacity or trace more sequences).
        """
        eams = np.asarray(eams, dtype=np.float32)
        if eams.ndim != 3 or eams.shape[0] == 0:
            raise ValueError(f"need [N, L, E] EAMs with N >= 1, got shape {eams.shape}")
        if capacity < 1:
            raise ValueError(f"EAMC capacity must be >= 1, got {capacity}")
        points = flat_unit_rows(eams)  # [N, L*E]
        distinct = distinct_count(points)
        if capacity > distinct:
            raise ValueError(f"EAMC capacity {capacity} exceeds the {distinct} distinct EAMs traced; "
                             "lower --capacity (eamc_capacity) or trace more sequences")
        meta = dict(meta or {}, capacity=capacity, seed=seed, num_sequences=int(eams.shape[0]))
        if capacity == eams.shape[0]:
            return cls(eams, meta)
        keep = kmeans_medoids(points, capacity, seed=seed, n_init=n_init)
        return cls(eams[keep], meta)

    # -- matching ---------------------------------------------------------------------------------

    def similarities(self, partial: np.ndarray, observed_layers: LayerSelection = None) -> np.ndarray:
        """`[P]` mean row cosine (1 - Eq. 1 distance) of every entry to `partial` over the observed layers."""
        flat, query, count = self._query(partial, observed_layers)
        if count == 0:
            return np.zeros(self.capacity, dtype=np.float32)
        return (flat @ query) / np.float32(count)

    def match(self, partial: np.ndarray, observed_layers: LayerSelection = None) -> tuple[int, np.ndarray]:
        """The entry nearest (Eq. 1) to `partial` `[L, E]` over the observed layers: `(index, eam)`.

        `observed_layers`: None (all), the number of leading layers seen so far, or a boolean mask `[L]`.
        Ties go to the lowest index; with no layer observed, entry 0 is returned.
        """
        flat, query, _ = self._query(partial, observed_layers)
        index = int(np.argmax(flat @ query))
        return index, self.eams[index]

    def _query(self, partial: np.ndarray,
               observed_layers: LayerSelection) -> tuple[np.ndarray, np.ndarray, int]:
        if partial.shape != (self.num_layers, self.num_experts):
            raise ValueError(f"partial EAM must be [{self.num_layers}, {self.num_experts}], "
                             f"got {partial.shape}")
        if observed_layers is None or isinstance(observed_layers, (int, np.integer)):
            depth = self.num_layers if observed_layers is None else int(observed_layers)
            layer_mask(self.num_layers, depth)  # validates the range
            query = normalize_rows(partial[:depth]).reshape(-1)
            return self._flat[:, : depth * self.num_experts], query, depth
        mask = layer_mask(self.num_layers, observed_layers)
        rows = normalize_rows(partial)
        rows[~mask] = 0.0
        return self._flat, rows.reshape(-1), int(mask.sum())

    # -- persistence ------------------------------------------------------------------------------

    def save(self, path: str | Path, meta: Mapping[str, Any] | None = None) -> Path:
        """Write the EAMC as safetensors; `meta` is merged over `self.meta` into the JSON metadata.

        The metadata records at least: format, version, num_layers, num_experts, capacity; callers add
        fingerprint (of the traced model), top_k, datasets, num_sequences and build parameters.
        """
        from safetensors.numpy import save_file

        full = dict(self.meta, **(meta or {}))
        full.update(format=FORMAT, version=VERSION, num_layers=self.num_layers,
                    num_experts=self.num_experts, capacity=self.capacity)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file({"eams": np.ascontiguousarray(self.eams)}, str(tmp), metadata={"moeinf": json.dumps(full)})
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path, fingerprint: str | None = None) -> EAMC:
        """Read an EAMC file; with `fingerprint`, refuse a file traced on another model."""
        from safetensors import safe_open

        path = Path(path)
        with safe_open(str(path), framework="numpy") as f:
            raw = (f.metadata() or {}).get("moeinf")
            if raw is None or "eams" not in f.keys():
                raise ValueError(f"{path} is not a moeinf EAMC file (no 'moeinf' metadata or 'eams' tensor); "
                                 "build one with `moeinf trace`")
            eams = f.get_tensor("eams")
        meta = json.loads(raw)
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(f"{path}: unsupported EAMC format {meta.get('format')!r} version "
                             f"{meta.get('version')!r} (this moeinf reads {FORMAT!r} version {VERSION}); "
                             "re-run `moeinf trace`")
        if fingerprint is not None and meta.get("fingerprint") != fingerprint:
            raise EAMCMismatchError(
                f"{path} was traced on model fingerprint {meta.get('fingerprint')!r}, but the model in use "
                f"has fingerprint {fingerprint!r}; trace this model into a new file with "
                "`moeinf trace MODEL_DIR --prompts ... --out NEW.eamc`")
        return cls(eams, meta)


def distinct_count(points: np.ndarray) -> int:
    """Number of distinct rows of `points` `[N, D]`."""
    return int(np.unique(points, axis=0).shape[0])


def kmeans_medoids(points: np.ndarray, k: int, *, seed: int = 0, n_init: int = 1) -> np.ndarray:
    """Indices (one per cluster, in cluster order) of the point nearest each K-Means centroid of `points`."""
    from sklearn.cluster import KMeans

    km = KMeans(n_clusters=k, n_init=n_init, random_state=seed).fit(points)
    keep = np.empty(k, dtype=np.int64)
    for cluster in range(k):
        members = np.flatnonzero(km.labels_ == cluster)
        gaps = ((points[members] - km.cluster_centers_[cluster]) ** 2).sum(axis=1)
        keep[cluster] = members[int(np.argmin(gaps))]
    log.debug("K-Means: %d points -> %d clusters, inertia %.4f, %d iterations",
              points.shape[0], k, km.inertia_, km.n_iter_)
    return keep
