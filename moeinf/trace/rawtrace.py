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
        """`Routed.step_counts` of this request."""
        return Routed.of(self).step_counts(weighted=weighted)

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


@dataclass(frozen=True)
class Routed:
    """One request's routed tokens as flat arrays, what counts are built from without a numpy call per step:
    token n of the request ran layer `layers[n]` in step `steps[n]` and went to experts `ids[n]` ([N, k],
    -1: none) with gate weights `weights[n]` ([N, k] float32; None where they were not read). Tokens of
    one (step, layer) are in their order in the trace."""

    id: str
    task: str
    num_layers: int
    num_experts: int
    top_k: int
    num_steps: int
    steps: np.ndarray
    layers: np.ndarray
    ids: np.ndarray
    weights: np.ndarray | None

    @classmethod
    def of(cls, raw: RawTrace) -> Routed:
        """The tokens of a `RawTrace`; a cell without gate weights weighs its first listed expert 1, the
        others 0."""
        cells = [(s, layer, np.asarray(ids).reshape(len(ids), -1), weights)
                 for s, step in enumerate(raw.steps) for layer, (ids, weights) in step.items()
                 if np.size(ids)]
        if not cells:
            empty = np.zeros(0, dtype=np.int64)
            return cls(raw.id, raw.task, raw.num_layers, raw.num_experts, raw.top_k, len(raw.steps), empty,
                       empty, np.zeros((0, raw.top_k), dtype=np.int64), np.zeros((0, raw.top_k), np.float32))
        sizes = [len(ids) for _, _, ids, _ in cells]
        gates = [np.asarray(weights, dtype=np.float32).reshape(ids.shape) if np.size(weights) == ids.size
                 else np.eye(1, ids.shape[1], dtype=np.float32).repeat(len(ids), axis=0)
                 for _, _, ids, weights in cells]
        return cls(raw.id, raw.task, raw.num_layers, raw.num_experts, raw.top_k, len(raw.steps),
                   np.repeat([s for s, _, _, _ in cells], sizes),
                   np.repeat([layer for _, layer, _, _ in cells], sizes),
                   np.concatenate([ids for _, _, ids, _ in cells]).astype(np.int64), np.concatenate(gates))

    def step_counts(self, *, weighted: bool = False) -> np.ndarray:
        """`[S, L, E]` float32: tokens per expert, per layer, per step; `weighted` (needs the weights): each
        token counts k x its gate weight instead of 1 (1 again where the trace holds 1/k, as for a source
        without weights)."""
        shape = (self.num_steps, self.num_layers, self.num_experts)
        routed = self.ids >= 0
        steps = np.broadcast_to(self.steps[:, None], self.ids.shape)[routed]
        layers = np.broadcast_to(self.layers[:, None], self.ids.shape)[routed]
        if weighted:
            if self.weights is None:
                raise ValueError("weighted counts need the gate weights (read with weights=True)")
            counts = np.zeros(shape, dtype=np.float32)
            # a weight rounded to 0 still marks an access
            np.add.at(counts, (steps, layers, self.ids[routed]),
                      np.maximum(self.top_k * self.weights[routed], 1e-6))
            return counts
        flat = (steps * self.num_layers + layers) * self.num_experts + self.ids[routed]
        return np.bincount(flat, minlength=int(np.prod(shape))).astype(np.float32).reshape(shape)


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
    without building the per-layer id arrays of `RawTrace` (`read_routed`: ~10x faster). Counts need no
    gate weights: they are cut from each line before it is parsed (they are about 70% of a line; parsing
    fell from 9.6 to 3.5 CPU seconds on a 157 MB trace)."""
    for routed in read_routed(path, weights=False):
        yield routed.id, routed.task, routed.top_k, routed.step_counts()


def read_routed(path: str | Path, *, weights: bool = True) -> Iterator[Routed]:
    """Stream each request's routed tokens as flat arrays (`Routed`); `weights=False` leaves the gate
    weights unread (`Routed.weights` is None)."""
    for number, line in _lines(path):
        try:
            yield _routed(_record(line if weights else _WEIGHTS.sub('"weights": []', line)), weights=weights)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise RawTraceError(f"{path}:{number}: bad record: {_describe(exc)}") from exc


def load_step_counts(path: str | Path) -> list[tuple[str, str, np.ndarray]]:
    """Per request `(id, task, counts [S, L, E])`: the input of the offline cache simulator."""
    return [(rid, task, counts) for rid, task, _, counts in read_step_counts(path)]


def _describe(exc: Exception) -> str:
    return f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)


def _routed(record: dict[str, Any], *, weights: bool) -> Routed:
    rid, task = str(record["id"]), str(record["task"])
    num_layers, num_experts = int(record["num_layers"]), int(record["num_experts"])
    top_k = int(record["top_k"])
    steps = record["steps"]
    # the steps of one shape (the same layers, as many tokens each: every decode step) are converted with one
    # numpy call: a call per step cost more than parsing (8 of 13 s on 117k steps of 24 layers)
    groups: dict[tuple[tuple[int, ...], int], list[int]] = {}
    for s, step in enumerate(steps):
        experts = step["experts"]
        groups.setdefault((tuple(step["layers"]), len(experts[0]) if len(experts) else 0), []).append(s)
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]] = []
    bad: list[tuple[int, str]] = []  # (step, what): the first step's is reported
    for (layer_list, _), group in groups.items():
        layers = np.asarray(layer_list, dtype=np.int64)  # [n]
        if layers.size and (layers.min() < 0 or layers.max() >= num_layers):
            bad.append((group[0], f"a layer outside 0..{num_layers - 1}"))
            continue
        try:
            ids = np.asarray([steps[s]["experts"] for s in group], dtype=np.int64)  # [B, n, T, k]
            gates = (np.asarray([steps[s]["weights"] for s in group], dtype=np.float32) if weights
                     else None)
        except ValueError:
            ids = gates = None  # ragged: an encoder-decoder step, or layers with different token counts
        if (ids is not None and ids.ndim == 4 and ids.shape[1] == layers.size and ids.shape[3] == top_k
                and (gates is None or gates.shape == ids.shape)):
            tokens = ids.shape[2]
            parts.append((np.repeat(np.asarray(group, dtype=np.int64), layers.size * tokens),
                          np.tile(np.repeat(layers, tokens), len(group)), ids.reshape(-1, top_k),
                          None if gates is None else gates.reshape(-1, top_k)))
            continue
        for s in group:
            try:
                parts.append(_step_tokens(s, steps[s], layers, top_k, weights))
            except ValueError as exc:
                bad.append((s, str(exc)))
    if parts:
        step_of, layer_of, ids = (np.concatenate([part[i] for part in parts]) for i in range(3))
        gates = np.concatenate([part[3] for part in parts]) if weights else None
        wrong = ((ids >= num_experts) | (ids < -1)).any(axis=1)
        if wrong.any():
            bad.append((int(step_of[wrong].min()), f"an expert id outside -1..{num_experts - 1}"))
    else:
        step_of, layer_of = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        ids = np.zeros((0, top_k), dtype=np.int64)
        gates = np.zeros((0, top_k), dtype=np.float32) if weights else None
    if bad:
        s, what = min(bad)
        raise ValueError(f"step {s}: {what}")
    return Routed(rid, task, num_layers, num_experts, top_k, len(steps), step_of,
                  layer_of, ids, gates)


def _step_tokens(s: int, step: dict[str, Any], layers: np.ndarray, top_k: int, weights: bool
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """One step's (step, layer, ids [T, k], weights [T, k]) per token, layer by layer."""
    rows = [np.asarray(row, dtype=np.int64).reshape(-1, top_k) for row in step["experts"]]
    if len(rows) != layers.size:
        raise ValueError(f"{layers.size} layers but {len(rows)} expert lists")
    sizes = [len(row) for row in rows]
    ids = np.concatenate(rows) if rows else np.zeros((0, top_k), dtype=np.int64)
    gates = None
    if weights:
        gate_rows = [np.asarray(row, dtype=np.float32).reshape(-1, top_k) for row in step["weights"]]
        if not any(len(row) for row in gate_rows):
            # a step without weights weighs each expert 1/k, as the traces of a source without them do
            gate_rows = [np.full((size, top_k), 1.0 / top_k, dtype=np.float32) for size in sizes]
        if [len(row) for row in gate_rows] != sizes:
            raise ValueError("the weights do not match the experts")
        gates = np.concatenate(gate_rows) if gate_rows else np.zeros((0, top_k), dtype=np.float32)
    return np.full(len(ids), s, dtype=np.int64), np.repeat(layers, sizes), ids, gates


def step_accesses(step_counts: np.ndarray) -> list[tuple[int, int]]:
    """The `(layer, expert)` keys one step `[L, E]` needs, in compute order (layer, then expert id)."""
    layers, experts = np.nonzero(step_counts)
    return list(zip(layers.tolist(), experts.tolist(), strict=True))
