"""Answer prompts in batches through one model, writing each answer as soon as it is finished.

Two engines. `run_continuous` (what `moeinf batch` runs): the server's running batch
(`moeinf.serve.running.RunningBatch`) without the server: up to `batch_size` rows decode together, prompts
join in groups, left-padded in one prefill pass, and a finished row leaves at once. `run_batches`: fixed
batches left-padded to the longest (`pad_batch`) through transformers' `generate` (on the offloaded e2e
model its batched passes were ~4.6x slower than the running batch's, cause not found; kept as the
reference path). Through an offloaded model each expert a step routes to is read once per layer for
the whole batch and computed for all its tokens, so reads amortise over the rows.

Both give HF's greedy tokens for the same padded batch (tests/test_batch_exact.py). A prompt's
answer alone and in a batch can differ: with padding, the attention of a row runs over more (masked)
positions and the batched products may sum in another order than a one-row product, so in bf16 logits
can differ in the last bit and a near-tie can flip a greedy token (fp32 makes this rare, not impossible;
docs/benchmarks.md says how often).
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO, TypeVar

import torch

from .jobs import Answers, Prompt


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    generate_kwargs: dict[str, Any] = field(default_factory=lambda: {"do_sample": False})
    """transformers `generate` keywords of sampling (`options.hf_sampling`); greedy by default."""
    seed: int = 0
    """Each batch samples with seed + its first prompt's position."""
    ignore_eos: bool = False
    """Every answer runs to max_new_tokens (benchmarks of fixed lengths)."""


def pad_batch(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded `input_ids` [B, T] and `attention_mask` [B, T] (1 = real token) of token lists."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids, mask


def pad_id_of(tokenizer: Any, config: Any) -> int:
    """The id padding positions hold: the tokenizer's pad, else the model's, else EOS, else 0 (the mask
    hides them, so any id gives the same answers)."""
    for value in (getattr(tokenizer, "pad_token_id", None), getattr(config, "pad_token_id", None)):
        if isinstance(value, int):
            return value
    eos = eos_ids(config)
    return eos[0] if eos else 0


def eos_ids(config: Any) -> list[int]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def answer_tokens(new: Sequence[int], stop: Sequence[int]) -> list[int]:
    """The generated tokens up to (without) the first stop token: `generate` pads finished rows after it."""
    out = []
    for token in new:
        if token in stop:
            break
        out.append(int(token))
    return out


@dataclass
class Progress:
    """Prompts done, tokens/s and ETA on stderr: one line redrawn on a terminal, else a line every
    `every_s` seconds (and at the end), so logs of a long job stay readable."""

    total: int
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    every_s: float = 10.0
    tty: bool | None = None
    done: int = 0
    tokens: int = 0
    start: float = field(default_factory=time.perf_counter)
    _last: float = -math.inf

    def __post_init__(self) -> None:
        if self.tty is None:
            self.tty = self.stream.isatty()

    def update(self, prompts: int, tokens: int) -> None:
        self.done += prompts
        self.tokens += tokens
        now = time.perf_counter()
        if self.tty or now - self._last >= self.every_s or self.done >= self.total:
            self._last = now
            end = "\n" if not self.tty or self.done >= self.total else ""
            self.stream.write(("\r" if self.tty else "") + self.line(now) + end)
            self.stream.flush()

    def line(self, now: float | None = None) -> str:
        elapsed = (now or time.perf_counter()) - self.start
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        left = self.total - self.done
        eta = elapsed / self.done * left if self.done else math.inf
        eta_text = "?" if math.isinf(eta) else f"{eta:.0f}s"
        return (f"prompts {self.done}/{self.total}  {self.tokens} tokens  {rate:.1f} tok/s  "
                f"elapsed {elapsed:.0f}s  ETA {eta_text}")


@dataclass
class BatchResult:
    prompts: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


T = TypeVar("T")

GenerateFn = Callable[..., torch.Tensor]
"""`generate(input_ids, attention_mask=..., max_new_tokens=..., pad_token_id=..., ...)` -> [B, T + new]
(MoE.generate or a transformers model's generate)."""


def run_batches(generate: GenerateFn, tokenizer: Any, config: Any, prompts: Sequence[Prompt],
                batch_size: int, sampling: Sampling, answers: Answers | None = None,
                progress: Progress | None = None,
                on_batch: Callable[[list[Prompt], list[list[int]]], None] | None = None) -> BatchResult:
    """Generate answers for `prompts` in order, `batch_size` at a time; each answer is written to `answers`
    (when given) as soon as its batch finishes. Returns the totals of this call."""
    pad = pad_id_of(tokenizer, config)
    stop = eos_ids(config)
    result = BatchResult()
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        group = list(prompts[first:first + batch_size])
        rows = [tokenizer.encode(p.prompt) for p in group]
        ids, mask = pad_batch(rows, pad)
        torch.manual_seed(sampling.seed + first)
        extra = {"min_new_tokens": sampling.max_new_tokens} if sampling.ignore_eos else {}
        out = generate(ids, attention_mask=mask, max_new_tokens=sampling.max_new_tokens, pad_token_id=pad,
                       **sampling.generate_kwargs, **extra)
        new_rows = [answer_tokens(out[i, ids.shape[1]:].tolist(), [] if sampling.ignore_eos else stop)
                    for i in range(len(group))]
        for prompt, new in zip(group, new_rows, strict=True):
            if answers is not None:
                answers.write(prompt.id, tokenizer.decode(new, skip_special_tokens=True), tokens=len(new))
        if on_batch is not None:
            on_batch(group, new_rows)
        tokens = sum(len(n) for n in new_rows)
        result.prompts += len(group)
        result.tokens += tokens
        if progress is not None:
            progress.update(len(group), tokens)
    result.seconds = time.perf_counter() - start
    return result


def run_continuous(open_batch: Callable[[], Any], tokenizer: Any, prompts: Sequence[Prompt], batch_size: int,
                   params: Any, answers: Answers | None = None, progress: Progress | None = None,
                   on_batch: Callable[[list[Prompt], list[list[int]]], None] | None = None,
                   join: int | None = None) -> BatchResult:
    """Generate answers with continuous batching (`moeinf.serve.running.RunningBatch` from `open_batch()`,
    whose passes are `moeinf.MoE`'s forward): up to `batch_size` rows decode together; a finished row
    leaves at once and its answer is written, and waiting prompts join in prefill passes of at most `join`
    prompts (default: every free row) once a quarter of the rows are free (a prefill pass reads most
    experts, so rows join in groups, not one by one). A pass pads its prompts to the longest: in length
    order, smaller joins pad less but each reads the experts again (the planner chooses, `Plan.join`).
    `params`: the `SamplingParams` of every row.

    The passes run on a thread of their own, as in the server: where torch's OpenMP threads spin between
    ops (torch loaded without the passive wait the `moeinf` command sets, moeinf.kernels.openmp), the
    main thread's team holds the cores and runs slower; with the passive wait both take the same time."""
    return on_model_thread(lambda: _run_continuous(open_batch, tokenizer, prompts, batch_size, params,
                                                   answers, progress, on_batch, join))


def on_model_thread(work: Callable[[], T]) -> T:
    """`work()` on a dedicated thread (its result, or its exception raised here)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = work()
        except BaseException as exc:  # handed to the calling thread
            out["error"] = exc

    thread = threading.Thread(target=run, name="moeinf-batch", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)  # in slices, so that Ctrl-C reaches the calling thread
    if "error" in out:
        raise out["error"]
    return out["result"]


def _run_continuous(open_batch: Callable[[], Any], tokenizer: Any, prompts: Sequence[Prompt], batch_size: int,
                    params: Any, answers: Answers | None, progress: Progress | None,
                    on_batch: Callable[[list[Prompt], list[list[int]]], None] | None,
                    join: int | None = None) -> BatchResult:
    batch = open_batch()
    join = join or batch_size
    queue = list(prompts)
    waiting_at = 0
    rows: dict[int, tuple[Prompt, list[int]]] = {}
    result = BatchResult()
    start = time.perf_counter()
    try:
        while waiting_at < len(queue) or len(batch):
            free = batch_size - len(batch)
            if waiting_at < len(queue) and (free >= max(1, batch_size // 4) or not len(batch)):
                group = queue[waiting_at:waiting_at + min(free, join)]
                keys = list(range(waiting_at, waiting_at + len(group)))
                waiting_at += len(group)
                rows.update({k: (p, []) for k, p in zip(keys, group, strict=True)})
                events = batch.join(keys, [tokenizer.encode(p.prompt) for p in group], [params] * len(group))
            else:
                events = batch.step()
            done = []
            for event in events:
                if event.error is not None:
                    raise RuntimeError(f"prompt {rows[event.index][0].id!r} failed: {event.error}")
                if event.finish_reason != "stop":  # a stop token ends the answer without being part of it
                    rows[event.index][1].append(event.token_id)
                if event.finish_reason is not None:
                    done.append(event.index)
            for key in done:
                prompt, tokens = rows.pop(key)
                if answers is not None:
                    text = tokenizer.decode(tokens, skip_special_tokens=True)
                    answers.write(prompt.id, text, tokens=len(tokens))
                if on_batch is not None:
                    on_batch([prompt], [tokens])
                result.prompts += 1
                result.tokens += len(tokens)
                if progress is not None:
                    progress.update(1, len(tokens))
    finally:
        batch.close()
    result.seconds = time.perf_counter() - start
    return result
