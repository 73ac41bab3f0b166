"""Iteration-level (continuous) batching over a transformers causal LM: sequences join and leave a
running batch between decode steps, each keeping its own rows of one shared KV cache.

Why not transformers' own continuous batching manager (`generate_batch`, paged attention)? It packs
every sequence of a step into one ragged row (`input_ids [1, total_tokens]` with cumulative sequence
lengths), while moeinf's runtime keys expert activation matrices by batch row (`Offloader`); and it
owns the generation loop and its thread, so the server's streaming, cancellation and per-request
sampling would sit behind it. The scheduler below is small instead:

    join(prompts)  prefill the new sequences together (left-padded, as a batch of their own), sample
                   their first tokens, then append their KV rows to the running cache, left-padding
                   whichever side is shorter (zeros under a 0 attention mask)
    step()         one decode step of every running row: [B, 1] tokens, each at its own position
    leave(keys)    drop rows at once (KV rows, mask rows, and the runtime's per-row state);
                   leading columns no row attends to any more are cut off

A row's logits do not depend on the other rows: padding keys are masked and positions count real
tokens only, so each answer equals the one the sequence gets alone (tests compare greedy tokens).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

log = logging.getLogger(__name__)


MIN_TEMPERATURE = 1e-5
"""Temperatures below this decode greedily: dividing logits by a smaller one overflows float32 (1e-38
turned every logit into inf and the softmax into NaN), and sampling that sharp is argmax anyway."""
SEED_RANGE = (-(2**63), 2**64 - 1)
"""The seeds `torch.Generator.manual_seed` accepts (inclusive)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is decoded. `temperature` below `MIN_TEMPERATURE` (0 included) is greedy; `seed`
    makes sampling reproducible. Out-of-range values raise ValueError here, not on the model thread."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    """Tokens that end the sequence (the tokenizer's EOS is added unless `ignore_eos`)."""
    ignore_eos: bool = False
    """Generate exactly `max_tokens` tokens (trace replay forces the trace's output length)."""
    top_k: int = 0
    """Sample among the `top_k` most likely tokens only (0: no limit)."""
    repetition_penalty: float = 1.0
    """Divide the positive logits (multiply the negative ones) of tokens already in the prompt or the
    answer by this (1: off; as transformers' and llama.cpp's repetition penalty)."""

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, "
                             f"got {self.repetition_penalty!r}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            lo, hi = SEED_RANGE
            raise ValueError(f"seed must be an integer in [{lo}, {hi}], got {self.seed}")


@dataclass(frozen=True)
class StepToken:
    """One generated token of the sequence with key `index`."""

    index: int
    token_id: int
    finish_reason: str | None
    """None while running; "stop" (a stop token), "length" (max_tokens reached) or "error" (this row
    alone failed: `error` says why, `token_id` is -1; the other rows go on)."""
    error: str | None = None


class Sampler:
    """Per-sequence token choice with its own random generator, so a seed reproduces a sequence."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int] = ()):
        self.params = params
        self.generator: torch.Generator | None = None
        if params.temperature >= MIN_TEMPERATURE:
            self.generator = torch.Generator()
            self.generator.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
        self.seen: set[int] | None = set(prompt) if params.repetition_penalty != 1.0 else None
        """Tokens of the prompt and the answer, when a repetition penalty needs them."""
        self.argmax = self.generator is None and self.seen is None
        """The token is the argmax of the raw logits (RunningBatch takes it for the whole batch at once)."""

    def __call__(self, logits: torch.Tensor) -> int:  # logits: [V] float32
        if self.seen:
            seen = torch.tensor(sorted(self.seen), dtype=torch.long)
            picked = logits[seen]
            penalty = self.params.repetition_penalty
            logits = logits.clone()
            logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
        token = self._choose(logits)
        if self.seen is not None:
            self.seen.add(token)
        return token

    def _choose(self, logits: torch.Tensor) -> int:
        if self.generator is None:
            return int(torch.argmax(logits))
        if 0 < self.params.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least the first token).
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < self.params.top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=self.generator))


class _Failed:
    """The sampler of a row whose parameters could not make one: its first sample raises, so the row
    fails alone (`RunningBatch._sample`)."""

    generator = True
    argmax = False

    def __init__(self, error: Exception):
        self.error = error

    def __call__(self, logits: torch.Tensor) -> int:
        raise self.error


def _sampler(params: SamplingParams, prompt: Sequence[int] = ()) -> Sampler | _Failed:
    try:
        return Sampler(params, prompt)
    except (ValueError, RuntimeError, OverflowError, TypeError) as exc:
        return _Failed(exc)


@dataclass
class _Row:
    key: int
    sampler: Sampler | _Failed
    stops: frozenset[int]
    max_tokens: int
    count: int = 0
    finished: bool = False


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`t` with zeros prepended along `dim` up to `width`."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [missing, 0]  # F.pad lists dims from the last
    return F.pad(t, pad)


class RunningBatch:
    """The rows decoded together by one model (see the module docstring). Not thread-safe: one model
    thread drives it.

    `forward` runs a pass over the running rows; `prefill` the first pass of joining rows (for
    `moeinf.MoE`: `MoE.join`, which appends their EAMs after the running rows'); `on_rows_kept(keep)`
    tells the runtime which rows survive a `leave` (`MoE.keep_rows`).
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        prefill: Callable[..., Any],
        *,
        eos_token_ids: frozenset[int],
        pad_token_id: int,
        device: str = "cpu",
        on_rows_kept: Callable[[list[int]], None] | None = None,
        cache_keyword: str = "past_key_values",
    ):
        self._forward, self._prefill = forward, prefill
        self._cache_keyword = cache_keyword  # `moeinf.hf.model.cache_keyword` of the model
        self.eos_token_ids, self.pad_token_id, self.device = eos_token_ids, pad_token_id, device
        self._on_rows_kept = on_rows_kept
        self._rows: list[_Row] = []
        self._cache: Any = None
        self._mask = torch.zeros((0, 0), dtype=torch.long)  # [B, W] 1 = a real token in the cache
        self._next = torch.zeros((0, 1), dtype=torch.long)  # [B, 1] the token each row feeds next
        self._positions = torch.zeros((0, 1), dtype=torch.long)  # [B, 1] that token's position

    @property
    def keys(self) -> list[int]:
        """The keys of the rows still running (a row that finished leaves before the next pass)."""
        return [row.key for row in self._rows if not row.finished]

    def __len__(self) -> int:
        return len(self.keys)

    @torch.inference_mode()
    def join(
        self, keys: Sequence[int], prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
    ) -> list[StepToken]:
        """Prefill `prompts` (one key and SamplingParams each) and return their first tokens; they
        decode with the running rows from the next `step`."""
        if not (len(keys) == len(prompts) == len(params)) or not prompts:
            raise ValueError("join needs one key and one SamplingParams per prompt, and a prompt")
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if set(keys) & {row.key for row in self._rows}:
            raise ValueError(f"keys {sorted(set(keys) & {r.key for r in self._rows})} are already running")
        self._drop_finished()
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            input_ids[r, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[r, width - len(p) :] = 1
        # Positions count real tokens only; padding gets position 0 (it is masked anyway).
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        try:
            out = self._prefill(
                input_ids=input_ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                use_cache=True,
            )
        except BaseException:
            # The running rows are untouched; the runtime forgets the joining rows' state, if it kept any.
            if self._on_rows_kept:
                self._on_rows_kept(list(range(len(self._rows))))
            raise
        rows = [
            _Row(
                k,
                _sampler(p, prompt),
                p.stop_token_ids | (frozenset() if p.ignore_eos else self.eos_token_ids),
                p.max_tokens,
            )
            for k, p, prompt in zip(keys, params, prompts, strict=True)
        ]
        step = self._sample(rows, out.logits[:, -1, :])
        first = torch.tensor([[t.token_id] for t in step], dtype=torch.long)  # [n, 1]
        self._append(getattr(out, self._cache_keyword), mask, first, positions[:, -1:] + 1)
        self._rows.extend(rows)
        return step

    @torch.inference_mode()
    def step(self) -> list[StepToken]:
        """One decode step of every running row; returns their new tokens (empty with no rows)."""
        self._drop_finished()
        if not self._rows:
            return []
        self._mask = torch.cat([self._mask, torch.ones((len(self._rows), 1), dtype=torch.long)], dim=-1)
        out = self._forward(
            input_ids=self._next.to(self.device),
            attention_mask=self._mask.to(self.device),
            position_ids=self._positions.to(self.device),
            use_cache=True,
            **{self._cache_keyword: self._cache},
        )
        self._cache = getattr(out, self._cache_keyword)
        step = self._sample(self._rows, out.logits[:, -1, :])
        self._next = torch.tensor([[t.token_id] for t in step], dtype=torch.long)
        self._positions = self._positions + 1
        return step

    def leave(self, keys: Iterable[int]) -> None:
        """Drop the rows of `keys` (cancelled sequences) now."""
        gone = set(keys)
        self._keep([r for r, row in enumerate(self._rows) if row.key not in gone])

    def close(self) -> None:
        """Drop every row, finished or not: the runtime forgets them all (their EAMs are reported)."""
        self._rows = []
        self._cache = None
        self._mask = torch.zeros((0, 0), dtype=torch.long)
        self._next = self._positions = torch.zeros((0, 1), dtype=torch.long)
        if self._on_rows_kept:
            self._on_rows_kept([])

    # --- internals -------------------------------------------------------------------------------
    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> list[StepToken]:
        logits = logits.float().cpu()  # [B, V]
        greedy = logits.argmax(dim=-1).tolist()  # one call for every greedy row
        step = []
        for r, row in enumerate(rows):
            try:
                token = greedy[r] if row.sampler.argmax else row.sampler(logits[r])
            except Exception as exc:  # this row's sampling failed: it ends alone, the others go on
                log.warning("row %d failed to sample: %s", row.key, exc)
                row.finished = True
                step.append(StepToken(row.key, -1, "error", error=f"{type(exc).__name__}: {exc}"))
                continue
            row.count += 1
            reason = "stop" if token in row.stops else "length" if row.count >= row.max_tokens else None
            row.finished = reason is not None
            step.append(StepToken(row.key, token, reason))
        return step

    def _drop_finished(self) -> None:
        if any(row.finished for row in self._rows):
            self._keep([r for r, row in enumerate(self._rows) if not row.finished])

    def _keep(self, keep: list[int]) -> None:
        if len(keep) == len(self._rows):
            return
        self._rows = [self._rows[r] for r in keep]
        index = torch.tensor(keep, dtype=torch.long)
        self._mask, self._next, self._positions = self._mask[index], self._next[index], self._positions[index]
        if self._on_rows_kept:
            self._on_rows_kept(keep)
        if not keep:
            self._cache = None
            self._mask = torch.zeros((0, 0), dtype=torch.long)
            return
        self._cache.batch_select_indices(index.to(self.device))
        # Columns no remaining row attends to (the left padding of rows that left) are cut off.
        start = int(self._mask.any(dim=0).int().argmax())
        if start > 0:
            for layer in self._layers(self._cache):
                layer.keys, layer.values = layer.keys[:, :, start:], layer.values[:, :, start:]
            self._mask = self._mask[:, start:]

    def _append(
        self, cache: Any, mask: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Add prefilled rows (cache, mask [n, W'], next tokens, positions) after the running ones."""
        if self._cache is None:
            self._layers(cache)
            self._cache, self._mask = cache, mask
        else:
            width = max(self._mask.shape[1], mask.shape[1])
            for mine, theirs in zip(self._layers(self._cache), self._layers(cache), strict=True):
                mine.keys = torch.cat([_left_pad(mine.keys, width, 2), _left_pad(theirs.keys, width, 2)])
                mine.values = torch.cat(
                    [_left_pad(mine.values, width, 2), _left_pad(theirs.values, width, 2)]
                )
            self._mask = torch.cat([_left_pad(self._mask, width, 1), _left_pad(mask, width, 1)])
        self._next = torch.cat([self._next, next_ids])
        self._positions = torch.cat([self._positions, positions])

    @staticmethod
    def _layers(cache: Any) -> list[DynamicLayer]:
        layers = list(getattr(cache, "layers", None) or [])
        if not layers or any(type(layer) is not DynamicLayer for layer in layers):
            kinds = sorted({type(layer).__name__ for layer in layers})
            raise TypeError(
                f"continuous batching needs a DynamicCache of full-attention layers, got {kinds or cache!r}; "
                "serve this model with --batching static"
            )
        return layers
