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

Files are read as they come, `.jsonl` or gzip-compressed `.jsonl.gz` (recognised by its magic bytes), one
request at a time; a bad record raises `RawTraceError` naming the file and line.

The cache simulator consumes `load_step_counts(path)`: per request, `counts [S, L, E]` float32 where
`counts[s, l, e]` is the number of tokens of step `s` that layer `l` routed to expert `e`. The EAM of the
sequence after step `s` is `counts[: s + 1].sum(axis=0)`; the experts that step `s` needs, in compute
order, are `step_accesses(counts[s])`.
"""

from __future__ import annotations

import gzip
import io
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from .eam import add_tokens, empty_eam

FORMAT = "moeinf-rawtrace"
VERSION = 1
GZIP_MAGIC = b"\x1f\x8b"
_WEIGHTS = re.compile(r'"weights":\s*\[[\d\s.,\[\]eE+-]*\]')
"""A step's gate weights: a JSON array of numbers only, so it ends at the last `]` before a quote or brace."""


class RawTraceError(ValueError):
    """A raw trace file cannot be read; the message names the file and, for a bad record, the line."""


@dataclass(frozen=True)
class RawTrace:
    """One request's routing. `steps[s]` maps MoE layer -> (expert ids `[T, k]`, weights `[T, k]`)."""

    id: str
    task: str
    num_layers: int
    num_experts: int
    top_k: int
    steps: list[dict[int, tuple[np.ndarray, np.ndarray]]]

    def step_counts(self, *, weighted: bool = False) -> np.ndarray:
        """`[S, L, E]` float32: tokens per expert, per layer, per step; `weighted`: each token counts k x
        its gate weight instead of 1 (1 again where the trace holds 1/k, as for a source without
        weights)."""
        counts = np.zeros((len(self.steps), self.num_layers, self.num_experts), dtype=np.float32)
        for s, step in enumerate(self.steps):
            for layer, (ids, weights) in step.items():
                if weighted:
                    routed = ids >= 0
                    # a weight rounded to 0 still marks an access
                    np.add.at(counts[s, layer], ids[routed], np.maximum(self.top_k * weights[routed], 1e-6))
                else:
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


def open_text(path: str | Path) -> TextIO:
    """`path` opened for reading text, decompressed on the fly if it is gzip (whatever its name)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            compressed = f.read(2) == GZIP_MAGIC
    except OSError as exc:
        raise RawTraceError(f"{path}: cannot read the trace: {exc.strerror or exc}") from exc
    if compressed:
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return path.open(encoding="utf-8")


def _lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of every non-blank line, streamed; a damaged file raises `RawTraceError`."""
    number = 0
    try:
        with open_text(path) as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield number, line
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise RawTraceError(f"{path}:{number + 1}: cannot read the trace: {exc}") from exc


def _record(line: str) -> dict[str, Any]:
    record = json.loads(line)
    if not isinstance(record, dict) or record.get("format") != FORMAT or record.get("version") != VERSION:
        found = record if not isinstance(record, dict) else (record.get("format"), record.get("version"))
        raise ValueError(f"not a {FORMAT} version {VERSION} record (found {found!r}); re-run "
                         "`moeinf trace --raw-out`")
    return record


def read_raw(path: str | Path) -> Iterator[RawTrace]:
    """Stream the traces of a JSONL (or .jsonl.gz) file."""
    for number, line in _lines(path):
        try:
            yield RawTrace.from_json(line)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise RawTraceError(f"{path}:{number}: bad record: {_describe(exc)}") from exc


def read_step_counts(path: str | Path) -> Iterator[tuple[str, str, int, np.ndarray]]:
    """Stream `(id, task, top_k, counts [S, L, E] float32)` per request (see `RawTrace.step_counts`),
    without building the per-layer id arrays of `RawTrace` (one array per step: ~10x faster). Counts
    need no gate weights: they are cut from each line before it is parsed (they are about 70% of a
    line; parsing fell from 9.6 to 3.5 CPU seconds on a 157 MB trace)."""
    for number, line in _lines(path):
        try:
            record = _record(_WEIGHTS.sub('"weights": []', line))
            yield (str(record["id"]), str(record["task"]), int(record["top_k"]), _step_counts(record))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise RawTraceError(f"{path}:{number}: bad record: {_describe(exc)}") from exc


def load_step_counts(path: str | Path) -> list[tuple[str, str, np.ndarray]]:
    """Per request `(id, task, counts [S, L, E])`: the input of the offline cache simulator."""
    return [(rid, task, counts) for rid, task, _, counts in read_step_counts(path)]


def _describe(exc: Exception) -> str:
    return f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)


def _step_counts(record: dict[str, Any]) -> np.ndarray:
    num_layers, num_experts = int(record["num_layers"]), int(record["num_experts"])
    steps = record["steps"]
    counts = np.zeros((len(steps), num_layers, num_experts), dtype=np.float32)
    size = num_layers * num_experts
    for s, step in enumerate(steps):
        layers = np.asarray(step["layers"], dtype=np.int64)  # [n]
        if layers.size and (layers.min() < 0 or layers.max() >= num_layers):
            raise ValueError(f"step {s}: a layer outside 0..{num_layers - 1}")
        try:
            ids = np.asarray(step["experts"], dtype=np.int64)  # [n, T, k] when every layer saw T tokens
        except ValueError:
            ids = None  # ragged: an encoder-decoder step, or layers with different token counts
        if ids is not None and ids.ndim == 3 and len(ids) == len(layers):
            flat = [(layers[:, None, None] * num_experts + ids)[ids >= 0]]
            bad = ids.size and (ids.max() >= num_experts or ids.min() < -1)
        else:
            rows = [np.asarray(row, dtype=np.int64).reshape(-1) for row in step["experts"]]
            if len(rows) != len(layers):
                raise ValueError(f"step {s}: {len(layers)} layers but {len(rows)} expert lists")
            flat = [layer * num_experts + row[row >= 0]
                    for layer, row in zip(layers.tolist(), rows, strict=True)]
            bad = any(row.size and (row.max() >= num_experts or row.min() < -1) for row in rows)
        if bad:
            raise ValueError(f"step {s}: an expert id outside -1..{num_experts - 1}")
        counts[s].reshape(-1)[:] = np.bincount(np.concatenate(flat), minlength=size)
    return counts


def step_accesses(step_counts: np.ndarray) -> list[tuple[int, int]]:
    """The `(layer, expert)` keys one step `[L, E]` needs, in compute order (layer, then expert id)."""
    layers, experts = np.nonzero(step_counts)
    return list(zip(layers.tolist(), experts.tolist(), strict=True))
