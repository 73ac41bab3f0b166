"""Raw routing traces: what every router decided, per request, per step, per layer, per token.

File format: JSONL, one request per line:

    {"format": "moeinf-rawtrace", "version": 1, "id": "gsm8k-12", "task": "math",
     "num_layers": L, "num_experts": E, "top_k": k,
     "steps": [{"layers": [0, 1, ...],                       MoE layers that ran in this step
                "experts": [[[e, e], [e, e], ...], ...],     per listed layer, per token: k expert ids
                "weights": [[[w, w], [w, w], ...], ...]}]}   the matching gate weights

A step is one forward of the model for this request: the prefill (all prompt tokens), then one step per
decoded token; an encoder-decoder has one encoder step (encoder layers only) before its decoder steps.
Only real tokens appear (no padding). Expert id -1 = the token went to no expert (Switch capacity drop).

The cache simulator consumes `load_step_counts(path)`: per request, `counts [S, L, E]` float32 where
`counts[s, l, e]` is the number of tokens of step `s` that layer `l` routed to expert `e`. The EAM of the
sequence after step `s` is `counts[: s + 1].sum(axis=0)`; the experts that step `s` needs, in compute
order, are `step_accesses(counts[s])`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .eam import add_tokens, empty_eam

FORMAT = "moeinf-rawtrace"
VERSION = 1


@dataclass(frozen=True)
class RawTrace:
    """One request's routing. `steps[s]` maps MoE layer -> (expert ids `[T, k]`, weights `[T, k]`)."""

    id: str
    task: str
    num_layers: int
    num_experts: int
    top_k: int
    steps: list[dict[int, tuple[np.ndarray, np.ndarray]]]

    def step_counts(self) -> np.ndarray:
        """`[S, L, E]` float32: tokens per expert, per layer, per step."""
        counts = np.zeros((len(self.steps), self.num_layers, self.num_experts), dtype=np.float32)
        for s, step in enumerate(self.steps):
            for layer, (ids, _) in step.items():
                add_tokens(counts[s], layer, ids)
        return counts

    def eam(self) -> np.ndarray:
        """The EAM `[L, E]` of the whole request."""
        eam = empty_eam(self.num_layers, self.num_experts)
        for step in self.steps:
            for layer, (ids, _) in step.items():
                add_tokens(eam, layer, ids)
        return eam

    def to_json(self) -> str:
        steps = []
        for step in self.steps:
            layers = sorted(step)
            steps.append({"layers": layers,
                          "experts": [step[layer][0].astype(int).tolist() for layer in layers],
                          "weights": [np.round(step[layer][1].astype(float), 6).tolist()
                                      for layer in layers]})
        return json.dumps({"format": FORMAT, "version": VERSION, "id": self.id, "task": self.task,
                           "num_layers": self.num_layers, "num_experts": self.num_experts,
                           "top_k": self.top_k, "steps": steps})

    @classmethod
    def from_json(cls, line: str) -> RawTrace:
        record = json.loads(line)
        if record.get("format") != FORMAT or record.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} version {VERSION} record: format {record.get('format')!r} "
                             f"version {record.get('version')!r}; re-run `moeinf trace --raw-out`")
        steps = []
        for step in record["steps"]:
            steps.append({layer: (np.asarray(ids, dtype=np.int64).reshape(-1, record["top_k"]),
                                  np.asarray(weights, dtype=np.float32).reshape(-1, record["top_k"]))
                          for layer, ids, weights in zip(step["layers"], step["experts"], step["weights"],
                                                         strict=True)})
        return cls(str(record["id"]), str(record["task"]), int(record["num_layers"]),
                   int(record["num_experts"]), int(record["top_k"]), steps)


def write_raw(path: str | Path, traces: Iterable[RawTrace], *, append: bool = False) -> Path:
    """Write (or append) traces as JSONL."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a" if append else "w", encoding="utf-8") as f:
        for trace in traces:
            f.write(trace.to_json() + "\n")
    return path


def read_raw(path: str | Path) -> Iterator[RawTrace]:
    """Stream the traces of a JSONL file."""
    with Path(path).open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield RawTrace.from_json(line)
            except (ValueError, KeyError) as exc:
                raise ValueError(f"{path}:{number}: {exc}") from exc


def load_step_counts(path: str | Path) -> list[tuple[str, str, np.ndarray]]:
    """Per request `(id, task, counts [S, L, E])`: the input of the offline cache simulator."""
    return [(t.id, t.task, t.step_counts()) for t in read_raw(path)]


def step_accesses(step_counts: np.ndarray) -> list[tuple[int, int]]:
    """The `(layer, expert)` keys one step `[L, E]` needs, in compute order (layer, then expert id)."""
    layers, experts = np.nonzero(step_counts)
    return list(zip(layers.tolist(), experts.tolist(), strict=True))
