"""Replay workloads: arrival times and token counts of an Azure LLM inference trace, with real prompt text.

The trace (CSV columns TIMESTAMP, ContextTokens, GeneratedTokens) holds no text. Each row becomes a
request whose prompt is real text from the prompt files (moeinf/data/prompts/*.jsonl), tokenised by
the served model's tokenizer and cut (or extended with the following prompts) to the row's context
length, and whose output length is forced to the row's generated length (`ignore_eos`).

Scaling: `rps_scale` divides inter-arrival gaps (2.0 = twice the request rate); `length_scale`
multiplies both token counts (small models on a CPU cannot afford the trace's ~1000-token prompts);
`max_new_tokens_cap` caps output lengths; a request never exceeds the model's context window.
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DEFAULT_TRACE = DATA_DIR / "azure" / "AzureLLMInferenceTrace_conv.csv"
DEFAULT_PROMPTS = DATA_DIR / "prompts"
TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True)
class TraceRow:
    """One trace request: arrival in seconds after the first row of the trace, and its token counts."""

    arrival_s: float
    context_tokens: int
    generated_tokens: int


@dataclass(frozen=True)
class WorkItem:
    """One request to replay: when it arrives (seconds after the start) and exactly what it asks."""

    index: int
    arrival_s: float
    prompt_ids: list[int]
    max_tokens: int
    prompt_source: str
    trace_context_tokens: int
    trace_generated_tokens: int


def _timestamp(text: str) -> datetime:
    # Upstream writes 7 fractional digits; datetime takes at most 6.
    head, _, frac = text.strip().partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}" if frac else head)


def load_trace(
    path: str | Path = DEFAULT_TRACE, *, start_s: float = 0.0, duration_s: float | None = None
) -> list[TraceRow]:
    """Rows arriving in [start_s, start_s + duration_s) of the trace, re-timed to start at 0."""
    rows: list[TraceRow] = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(
                f"{path}: missing column(s) {missing}; an Azure LLM inference trace has {list(TRACE_COLUMNS)}"
            )
        first: datetime | None = None
        for line_no, rec in enumerate(reader, start=2):
            try:
                when = _timestamp(rec["TIMESTAMP"])
                context, generated = int(rec["ContextTokens"]), int(rec["GeneratedTokens"])
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: cannot parse row {rec}: {exc}") from None
            first = first or when
            t = (when - first).total_seconds() - start_s
            if t < 0:
                continue
            if duration_s is not None and t >= duration_s:
                break
            rows.append(TraceRow(t, context, generated))
    if not rows:
        raise ValueError(
            f"{path}: no request in [{start_s}, {start_s} + {duration_s}) s; check --start-s / --duration"
        )
    return rows


def load_prompts(paths: Iterable[str | Path] = (DEFAULT_PROMPTS,)) -> list[dict[str, Any]]:
    """Prompt records ({"id", "task", "prompt", ...}) of the given .jsonl files or directories."""
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(sorted(p.glob("*.jsonl")) if p.is_dir() else [p])
    records = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            for number, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(
                        f"{f}:{number}: not a JSON object ({exc.msg}); one object per line"
                    ) from None
                if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str) or not rec["prompt"]:
                    raise ValueError(
                        f'{f}:{number}: needs a non-empty \'prompt\' string, like {{"prompt": "..."}}'
                    )
                records.append(rec)
    if not records:
        raise ValueError(f"no prompts found in {[str(p) for p in paths]}; give .jsonl files with --prompts")
    return records


def scale_rows(
    rows: Sequence[TraceRow],
    *,
    rps_scale: float = 1.0,
    length_scale: float = 1.0,
    max_new_tokens_cap: int | None = None,
) -> list[TraceRow]:
    """Arrivals compressed by `rps_scale`, token counts multiplied by `length_scale`, outputs capped."""
    if rps_scale <= 0 or length_scale <= 0:
        raise ValueError("--rps-scale and --length-scale must be > 0")
    out = []
    for r in rows:
        generated = max(1, round(r.generated_tokens * length_scale))
        if max_new_tokens_cap is not None:
            generated = min(generated, max_new_tokens_cap)
        out.append(
            TraceRow(r.arrival_s / rps_scale, max(1, round(r.context_tokens * length_scale)), generated)
        )
    return out


class PromptPool:
    """Builds prompts of an exact token length from real prompt text, in a fixed shuffled order."""

    def __init__(self, tokenizer: Any, records: Sequence[dict[str, Any]], *, seed: int = 0):
        self.tokenizer = tokenizer
        self.records = list(records)
        random.Random(seed).shuffle(self.records)
        self._ids: dict[int, list[int]] = {}
        self._next = 0

    def _encoded(self, i: int, first: bool) -> list[int]:
        key = i if first else -1 - i
        if key not in self._ids:
            text = self.records[i]["prompt"] if first else "\n\n" + self.records[i]["prompt"]
            self._ids[key] = list(self.tokenizer.encode(text, add_special_tokens=first))
        return self._ids[key]

    def take(self, length: int) -> tuple[list[int], str]:
        """The next prompt cut to `length` tokens, extended with the following prompts if shorter."""
        i = self._next % len(self.records)
        self._next += 1
        ids = list(self._encoded(i, first=True))
        j = i
        while len(ids) < length:
            j = (j + 1) % len(self.records)
            ids.extend(self._encoded(j, first=False))
        return ids[:length], str(self.records[i].get("id", i))


def build_workload(rows: Sequence[TraceRow], pool: PromptPool, *, context_length: int) -> list[WorkItem]:
    """One WorkItem per (scaled) row; prompts are shortened where prompt + output exceed the context."""
    items = []
    for n, row in enumerate(rows):
        max_tokens = min(row.generated_tokens, context_length - 1)
        length = max(1, min(row.context_tokens, context_length - max_tokens))
        ids, source = pool.take(length)
        items.append(
            WorkItem(n, row.arrival_s, ids, max_tokens, source, row.context_tokens, row.generated_tokens)
        )
    return items
