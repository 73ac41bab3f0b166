"""The model side of the server: batched token-step generation over any HuggingFace-style causal LM.

The server, the chat command and the replay only talk to `Backend`. `HFBackend` implements it over
an object that is called like a transformers causal LM (`model(input_ids=..., attention_mask=...,
position_ids=..., cache=..., use_cache=True) -> .logits, .cache`): an unmodified
`from_pretrained` model or `moeinf.MoE`, which forwards to the HF model it wraps.

Batched generation is exact: prompts are left-padded, the attention mask hides the padding and
position ids count only real tokens, so a sequence's greedy tokens in a batch equal its greedy tokens
alone. Rows join and leave a `RunningBatch` between steps (continuous batching, `moeinf.serve.running`);
`generate` is the static case, one batch from start to end.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

from .running import RunningBatch, SamplingParams, StepToken

__all__ = ["Backend", "HFBackend", "RunningBatch", "SamplingParams", "StepToken", "context_length_of"]

log = logging.getLogger(__name__)


class Backend(ABC):
    """What the server needs from a model.

    Contract: `open_batch` returns an empty `RunningBatch` of this model (one at a time: the runtime
    keeps per-row state). `generate` runs one static batch over it: it yields, after every decoding
    step, the new token of every sequence still running; a sequence ends after the step that yields
    it with a finish reason, or as soon as its index is in `done` (checked before every step), which
    frees its row. Outputs of one sequence do not depend on the others in the batch.
    """

    name: str
    tokenizer: Any
    context_length: int
    vocab_size: int
    eos_token_ids: frozenset[int]

    @abstractmethod
    def open_batch(self) -> RunningBatch: ...

    def generate(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], done: Collection[int] = ()
    ) -> Iterator[list[StepToken]]:
        if len(prompts) != len(params) or not prompts:
            raise ValueError("generate needs one SamplingParams per prompt and at least one prompt")
        batch = self.open_batch()
        try:
            yield batch.join(range(len(prompts)), prompts, params)
            while True:
                batch.leave(i for i in batch.keys if i in done)
                if not len(batch):
                    return
                yield batch.step()
        finally:
            batch.close()

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


class HFBackend(Backend):
    """`Backend` over a transformers-style causal LM (an HF model or `moeinf.MoE`).

    `model` is the transformers model (its config and generation config are read); `forward`, when
    given, is what is called instead of it (`moeinf.MoE`), and `prefill` what runs the first pass of
    sequences joining a running batch (`MoE.join`; default `forward`).
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
        prefill: Callable[..., Any] | None = None,
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
        self.prefill = prefill or self.forward
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

    def open_batch(self) -> RunningBatch:
        from moeinf.hf.model import cache_keyword

        return RunningBatch(
            self.forward,
            self.prefill,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            device=self.device,
            on_rows_kept=self._on_rows_kept,
            cache_keyword=cache_keyword(self.model),
        )

