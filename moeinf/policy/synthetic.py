"""Synthetic routing traces with the structure MoE-Infinity reports for real models, for the simulator
and the benchmarks until traces of a trained model exist. Results on them are labelled synthetic.

Structure: each MoE layer has a skewed global expert popularity; each task (a family of prompts) has
its own sparse preference per layer and, per layer, a core working set (its most preferred experts);
each sequence draws a task, takes its core working set with each member replaced, with probability
`variation`, by another expert drawn from the task's preference, and routes most of its tokens
(`reuse`) inside that working set with sequence-specific weights, the rest by the global
popularity. Every token picks `top_k` distinct experts per layer.
Sequences of one task therefore share much of their routing (what an EAMC learns), and a sequence
keeps reusing its own experts over its tokens (what activation-aware caching exploits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import PolicyError


@dataclass(frozen=True)
class SyntheticModel:
    """The routing statistics of one synthetic MoE model; `traces` samples sequences from it."""

    num_layers: int
    num_experts: int
    top_k: int
    num_tasks: int = 4
    working_set: int = 0
    """Experts per layer a sequence mostly uses; 0 = 2 * top_k."""
    reuse: float = 0.85
    """Share of routing probability inside the sequence's working set."""
    variation: float = 0.25
    """Probability that a member of the task's core working set is swapped for this sequence."""
    prompt_tokens: tuple[int, int] = (16, 64)
    new_tokens: tuple[int, int] = (16, 48)
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise PolicyError(f"top_k must lie in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.num_layers < 1 or self.num_tasks < 1:
            raise PolicyError("num_layers and num_tasks must be >= 1")
        if not 0.0 <= self.reuse <= 1.0:
            raise PolicyError(f"reuse must lie in [0, 1], got {self.reuse}")
        if not 0.0 <= self.variation <= 1.0:
            raise PolicyError(f"variation must lie in [0, 1], got {self.variation}")

    def _tables(self) -> tuple[np.ndarray, np.ndarray]:
        """Global popularity [L, E] and task preferences [T, L, E], fixed by the model's seed."""
        rng = np.random.default_rng(self.seed)
        shape = (self.num_layers, self.num_experts)
        glob = rng.dirichlet(np.full(self.num_experts, 0.7), size=self.num_layers).reshape(shape)
        task = rng.dirichlet(np.full(self.num_experts, 0.15), size=(self.num_tasks, self.num_layers))
        return glob, 0.8 * task + 0.2 * glob[None]

    def traces(self, num_sequences: int, *, seed: int = 1) -> tuple[list[np.ndarray], list[int]]:
        """`num_sequences` traces ([S, L, E] int32 token counts, step 0 = prefill) and their task ids."""
        glob, task_pref = self._tables()
        rng = np.random.default_rng(seed)
        width = min(self.num_experts, self.working_set or 2 * self.top_k)
        traces, tasks = [], []
        for _ in range(num_sequences):
            task = int(rng.integers(self.num_tasks))
            probs = np.empty((self.num_layers, self.num_experts))  # [L, E] routing distribution
            for layer in range(self.num_layers):
                chosen = self._working_set(rng, task_pref[task, layer], width)
                inside = np.zeros(self.num_experts)
                inside[chosen] = rng.dirichlet(np.ones(width))
                probs[layer] = self.reuse * inside + (1.0 - self.reuse) * glob[layer]
            prompt = int(rng.integers(self.prompt_tokens[0], self.prompt_tokens[1] + 1))
            steps = 1 + int(rng.integers(self.new_tokens[0], self.new_tokens[1] + 1))
            routed = self._route(rng, probs, prompt + steps - 1)  # [T, L, E] 0/1
            trace = np.empty((steps, self.num_layers, self.num_experts), dtype=np.int32)
            trace[0] = routed[:prompt].sum(axis=0)
            trace[1:] = routed[prompt:]
            traces.append(trace)
            tasks.append(task)
        return traces, tasks

    def _working_set(self, rng: np.random.Generator, preference: np.ndarray, width: int) -> np.ndarray:
        """The task's `width` most preferred experts, each swapped with probability `variation` for
        another expert drawn from `preference` [E]."""
        chosen = np.argsort(-preference, kind="stable")[:width]
        for slot in np.flatnonzero(rng.random(width) < self.variation):
            others = np.setdiff1d(np.arange(self.num_experts), chosen)
            if len(others):
                weights = preference[others] / preference[others].sum()
                chosen[slot] = rng.choice(others, p=weights)
        return chosen

    def _route(self, rng: np.random.Generator, probs: np.ndarray, tokens: int) -> np.ndarray:
        """Top-k distinct experts per token and layer, drawn without replacement in proportion to
        `probs` (Gumbel top-k): [T, L, E] with exactly top_k ones per (token, layer)."""
        with np.errstate(divide="ignore"):
            logits = np.log(probs)[None]  # [1, L, E]
        keys = logits + rng.gumbel(size=(tokens, self.num_layers, self.num_experts))  # [T, L, E]
        top = np.argpartition(-keys, self.top_k - 1, axis=2)[..., : self.top_k]  # [T, L, k]
        routed = np.zeros(keys.shape, dtype=np.int32)
        np.put_along_axis(routed, top, 1, axis=2)
        return routed
