"""Incremental EAMC matching for the runtime.

The runtime learns a sequence's routing a few tokens at a time: after the router of layer l it knows
which experts this step's tokens chose there, and it wants the EAMC entry nearest the partial EAM over
layers 0..l. Recomputing `EAMC.match` from scratch reads the whole `[P, (l+1)*E]` collection each time.
`Matcher` keeps, per layer, the unnormalised dot products `raw[l, p] = <U_p[l], counts[l]>` of every
entry's unit row with the running counts, and the row norms. A token routed to expert e of layer l adds
`U[:, l, e]` to `raw[l]`; the similarity over the leading d layers is
`sum_l raw[l] / ||counts[l]||` (one `[d] @ [d, P]` product), equal to `EAMC.similarities(counts, d) * d`
up to float32 rounding. So an update costs one `[n] @ [n, P]` product for the n experts whose count
changed (at most `[E] @ [E, P]`) and a match one `[d] @ [d, P]`, instead of `[P, d*E] @ [d*E]`.
"""

from __future__ import annotations

import numpy as np

from .eamc import EAMC


class Matcher:
    """The running EAM of one sequence (or batch) and its nearest EAMC entry, updated incrementally.

    Bound to one EAMC: after an online swap, make a new matcher (`Matcher(OnlineEAMC.current)`).
    """

    def __init__(self, eamc: EAMC) -> None:
        self.eamc = eamc
        self.counts = np.zeros((eamc.num_layers, eamc.num_experts), dtype=np.float32)
        """The running EAM `[L, E]` as the matcher has been told it."""
        self._raw = np.zeros((eamc.num_layers, eamc.capacity), dtype=np.float32)  # [L, P]
        self._inv_norm = np.zeros(eamc.num_layers, dtype=np.float32)  # 1 / ||counts[l]||, 0 when empty
        self._total = np.empty(eamc.capacity, dtype=np.float32)

    def reset(self) -> None:
        """Start a new sequence."""
        self.counts.fill(0.0)
        self._raw.fill(0.0)
        self._inv_norm.fill(0.0)

    def add(self, layer: int, expert_ids: np.ndarray) -> None:
        """Count one token per entry of `expert_ids` (any shape; -1 = no expert) at MoE layer `layer`."""
        ids = np.asarray(expert_ids).reshape(-1)
        if ids.size > 16:  # a prefill: tally first, one product
            tally = np.bincount(ids[ids >= 0], minlength=self.eamc.num_experts).astype(np.float32)
            self._apply(layer, tally)
            return
        # A decode step: gather the k columns and add their sum, a handful of numpy calls in all (a
        # per-expert loop costs two calls per expert, and call overhead is most of a decode step's cost).
        ids = ids[ids >= 0]
        if ids.size:
            self._raw[layer] += self.eamc.unit_columns[layer][ids].sum(axis=0)
            self.counts[layer] += np.bincount(ids, minlength=self.eamc.num_experts)
        self._renormalise(layer)

    def update(self, layer: int, row: np.ndarray) -> None:
        """Layer `layer` of the running EAM now holds the counts `row` `[E]`."""
        self._apply(layer, np.asarray(row, dtype=np.float32) - self.counts[layer])

    def update_all(self, eam: np.ndarray, depth: int | None = None) -> None:
        """Set the leading `depth` layers (all by default) from a whole EAM `[L, E]`."""
        for layer in range(self.eamc.num_layers if depth is None else depth):
            self.update(layer, eam[layer])

    def match(self, depth: int | None = None) -> tuple[int, np.ndarray]:
        """The entry nearest (Eq. 1) over the leading `depth` layers (all by default): `(index, eam)`."""
        depth = self.eamc.num_layers if depth is None else depth
        np.matmul(self._inv_norm[:depth], self._raw[:depth], out=self._total)
        index = int(np.argmax(self._total))
        return index, self.eamc.eams[index]

    def similarities(self, depth: int | None = None) -> np.ndarray:
        """`[P]` mean row cosine of every entry to the running EAM over the leading `depth` layers."""
        depth = self.eamc.num_layers if depth is None else depth
        if depth == 0:
            return np.zeros(self.eamc.capacity, dtype=np.float32)
        return (self._inv_norm[:depth] @ self._raw[:depth]) / np.float32(depth)

    def _apply(self, layer: int, delta: np.ndarray) -> None:
        columns = self.eamc.unit_columns[layer]  # [E, P]
        changed = np.flatnonzero(delta)
        if 4 * changed.size < delta.size:  # a decode step: read only the columns of the chosen experts
            self._raw[layer] += delta[changed] @ columns[changed]
        else:
            self._raw[layer] += delta @ columns
        self.counts[layer] += delta
        self._renormalise(layer)

    def _renormalise(self, layer: int) -> None:
        row = self.counts[layer]
        square = float(np.dot(row, row))
        self._inv_norm[layer] = 1.0 / np.sqrt(square) if square > 0 else 0.0
