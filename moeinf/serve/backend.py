"""The model side of the server: a batched token-step generator over any HuggingFace-style causal LM.

The server, the chat command and the replay only talk to `Backend`. `HFBackend` implements it over
an object that is called like a transformers causal LM (`model(input_ids=..., attention_mask=...,
position_ids=..., past_key_values=..., use_cache=True) -> .logits, .past_key_values`): an unmodified
`from_pretrained` model or `moeinf.MoE`, which forwards to the HF model it wraps.

Batched generation is exact: prompts are left-padded, the attention mask hides the padding and
position ids count only real tokens, so a sequence's greedy tokens in a batch equal its greedy tokens
alone. Finished (or cancelled) rows are dropped from the batch and from the KV cache at the next step.
"""

from __future__ import annotations

import logging
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is decoded. `temperature == 0` is greedy; `seed` makes sampling reproducible."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    """Tokens that end the sequence (the tokenizer's EOS is added unless `ignore_eos`)."""
    ignore_eos: bool = False
    """Generate exactly `max_tokens` tokens (trace replay forces the trace's output length)."""


@dataclass(frozen=True)
class StepToken:
    """One generated token of sequence `index` (its position in the batch as submitted)."""

    index: int
    token_id: int
    finish_reason: str | None
    """None while running; "stop" (a stop token) or "length" (max_tokens reached)."""


class Backend(ABC):
    """What the server needs from a model.

    Contract: `generate` runs one batch. It yields, after every decoding step, the new token of every
    sequence still running; a sequence ends after the step that yields it with a finish reason, or
    as soon as its index is in `done` (checked before every step), which frees its row. Outputs of
    one sequence do not depend on the others in the batch.
    """

    name: str
    tokenizer: Any
    context_length: int
    vocab_size: int
    eos_token_ids: frozenset[int]

    @abstractmethod
    def generate(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], done: Collection[int] = ()
    ) -> Iterator[list[StepToken]]: ...

    def stats(self) -> dict[str, float]:
        """Runtime counters (expert cache hits, misses, stall seconds...); empty when there are none."""
        return {}

    @abstractmethod
    def close(self) -> None:
        """Release the model's resources."""


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    config = getattr(model, "generation_config", None) or getattr(model, "config", None)
    for source in (config, getattr(model, "config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def context_length_of(config: Any) -> int:
    """The context window a transformers config states."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(
        "the model config states no context length (max_position_embeddings); "
        "pass context_length= to HFBackend"
    )


class _Sampler:
    """Per-sequence token choice with its own random generator, so a seed reproduces a sequence."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            self.generator = torch.Generator()
            self.generator.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))

    def __call__(self, logits: torch.Tensor) -> int:  # logits: [V] float32
        if self.generator is None:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least the first token).
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < self.params.top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=self.generator))


class HFBackend(Backend):
    """`Backend` over a transformers-style causal LM (an HF model or `moeinf.MoE`).

    `model` is the transformers model (its config and generation config are read); `forward`, when
    given, is what is called instead of it (`moeinf.MoE`, which announces new batches to its runtime).
    `on_rows_kept(keep)` is called when rows leave the batch, with the surviving row indices of the
    previous step, for runtimes that keep per-row state (the offloaded runtime keys EAMs by row).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str = "model",
        context_length: int | None = None,
        pad_token_id: int | None = None,
        stats_fn: Callable[[], dict[str, float]] | None = None,
        on_rows_kept: Callable[[list[int]], None] | None = None,
        close_fn: Callable[[], None] | None = None,
        forward: Callable[..., Any] | None = None,
        device: str = "cpu",
    ):
        config = model.config
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError(
                f"{config.model_type} is an encoder-decoder model; the server and the chat "
                "command serve decoder-only (causal) language models"
            )
        self.model = model
        self.forward = forward or model
        self.tokenizer = tokenizer
        self.name = name
        self.context_length = context_length or context_length_of(config)
        self.vocab_size = int(config.vocab_size)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        pad = pad_token_id if pad_token_id is not None else getattr(config, "pad_token_id", None)
        self.pad_token_id = int(pad) if isinstance(pad, int) else min(self.eos_token_ids, default=0)
        self.device = device
        self._stats_fn = stats_fn
        self._on_rows_kept = on_rows_kept
        self._close_fn = close_fn

    def stats(self) -> dict[str, float]:
        return dict(self._stats_fn()) if self._stats_fn else {}

    def close(self) -> None:
        if self._close_fn:
            self._close_fn()

    @torch.inference_mode()
    def generate(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], done: Collection[int] = ()
    ) -> Iterator[list[StepToken]]:
        if len(prompts) != len(params) or not prompts:
            raise ValueError("generate needs one SamplingParams per prompt and at least one prompt")
        for p in prompts:
            if not p:
                raise ValueError("every prompt needs at least one token")
        samplers = [_Sampler(p) for p in params]
        stops = [p.stop_token_ids | (frozenset() if p.ignore_eos else self.eos_token_ids) for p in params]
        counts = [0] * len(prompts)
        rows = list(range(len(prompts)))  # rows[r] = index of the sequence in batch row r

        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            input_ids[r, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[r, width - len(p) :] = 1
        # Positions count real tokens only; padding gets position 0 (it is masked anyway).
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = None
        finished: set[int] = set()
        while True:
            keep = [r for r, i in enumerate(rows) if i not in done and i not in finished]
            if not keep:
                return
            if len(keep) < len(rows):
                rows, input_ids, mask, positions = (
                    [rows[r] for r in keep],
                    input_ids[keep],
                    mask[keep],
                    positions[keep],
                )
                if cache is not None:
                    cache.batch_select_indices(torch.tensor(keep))
                if self._on_rows_kept:
                    self._on_rows_kept(keep)
            out = self.forward(
                input_ids=input_ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float().cpu()  # [B, V]
            step: list[StepToken] = []
            for r, i in enumerate(rows):
                token = samplers[i](logits[r])
                counts[i] += 1
                reason = (
                    "stop" if token in stops[i] else "length" if counts[i] >= params[i].max_tokens else None
                )
                step.append(StepToken(i, token, reason))
                if reason:
                    finished.add(i)
            input_ids = torch.tensor([[t.token_id] for t in step], dtype=torch.long)  # [B, 1]
            positions = positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=-1)
            yield step


def load_tokenizer_for(model_dir: str) -> Any:
    """The tokenizer of `model_dir`, through moeinf's loader (with its byte-level fallback)."""
    from moeinf.hf.tokenizer import load_tokenizer

    tokenizer, kind = load_tokenizer(model_dir)
    log.info("tokenizer of %s: %s", model_dir, kind)
    return tokenizer
