"""Synthetic EAMs with task structure, for tests and benchmarks of the EAMC (no model needed).

A workload has `tasks` task families; each task prefers some experts per layer (a Dirichlet draw per
layer). A sequence of `tokens` tokens sends each token to `top_k` distinct experts per layer, drawn from
its task's preferences (Gumbel top-k), as a trained router on a task's text does. A distribution shift
is a workload with other tasks (another seed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Workload:
    """Per-task expert preferences `[tasks, L, E]` (rows sum to 1)."""

    preferences: np.ndarray
    top_k: int

    @classmethod
    def make(cls, num_layers: int, num_experts: int, *, top_k: int = 2, tasks: int = 8,
             concentration: float = 0.1, seed: int = 0) -> Workload:
        rng = np.random.default_rng(seed)
        prefs = rng.dirichlet(np.full(num_experts, concentration), size=(tasks, num_layers))
        return cls(prefs.astype(np.float64), top_k)

    @property
    def num_tasks(self) -> int:
        return self.preferences.shape[0]

    def sample(self, n: int, *, tokens: int = 32, seed: int = 0, tasks: np.ndarray | None = None,
               exact: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """`n` sequences: (EAMs `[n, L, E]` float32, task ids `[n]`).

        `exact=False` draws each layer's `tokens * top_k` choices with replacement (one multinomial per
        layer): much faster for large models, with the same expected counts.
        """
        rng = np.random.default_rng(seed)
        if tasks is None:
            tasks = rng.integers(0, self.num_tasks, size=n)
        _, num_layers, num_experts = self.preferences.shape
        eams = np.zeros((n, num_layers, num_experts), dtype=np.float32)
        for i, task in enumerate(tasks):
            if not exact:
                eams[i] = rng.multinomial(tokens * self.top_k, self.preferences[task])
                continue
            logp = np.log(self.preferences[task] + 1e-12)  # [L, E]
            gumbel = rng.gumbel(size=(tokens, num_layers, num_experts))
            chosen = np.argpartition(-(logp[None] + gumbel), self.top_k - 1, axis=-1)[..., : self.top_k]
            np.add.at(eams[i], (np.arange(num_layers)[None, :, None], chosen), 1.0)
        return eams, np.asarray(tasks)
