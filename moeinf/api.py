"""`MoE`: a HuggingFace MoE model whose experts live in an expert store and are offloaded by moeinf.

    with MoE("path/to/model", OffloadConfig(device_cache="25%")) as model:
        out = model.generate(input_ids, max_new_tokens=32)
        print(model.stats())
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .builder import Runtime, build_runtime
from .config import ConfigError, OffloadConfig

log = logging.getLogger(__name__)


class MoE:
    """An offloaded MoE model: the unmodified transformers model with its experts served from SSD.

    Construction packs `model_dir` into `config.offload_dir` (default `<model_dir>.moeinf`) if needed,
    then loads dense weights and replaces the experts modules of this instance. It refuses, naming the
    knob, a compute-tier budget below `top_k` experts (one token of one layer needs its top_k experts
    resident together), a store of another model and an EAMC traced on another model.

    `generate` and `__call__` accept the transformers keyword arguments; one lock serialises them, so
    several threads may share one `MoE`.
    """

    def __init__(self, model_dir: str | Path,
                 config: OffloadConfig | Mapping[str, Any] | None = None) -> None:
        self.config = OffloadConfig.coerce(config)
        self.model_dir = Path(model_dir)
        self._lock = threading.RLock()
        self._runtime: Runtime | None = build_runtime(self.model_dir, self.config)
        self.model = self._runtime.model
        self.store = self._runtime.store
        self._tokenizer: Any = None

    # --- model calls ---------------------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """`transformers` generate on the offloaded model; the batch's sequences finish with the call."""
        runtime = self._live()
        with self._lock, torch.inference_mode():
            runtime.offloader.start(input_ids.shape[0])
            try:
                out = self.model.generate(input_ids, **kwargs)
            finally:
                runtime.offloader.finish()
            new = out.shape[1] - (1 if runtime.seq2seq else input_ids.shape[1])
            runtime.stats.tokens += max(new, 0) * out.shape[0]
        return out

    def __call__(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        """One forward pass; without a KV cache (`cache`, or `past_key_values` before transformers 5.24)
        the batch starts new sequences."""
        runtime = self._live()
        with self._lock, torch.inference_mode():
            if kwargs.get("cache") is None and kwargs.get("past_key_values") is None:
                runtime.offloader.start(input_ids.shape[0])
            try:
                return self.model(input_ids, **kwargs)
            finally:
                runtime.offloader.settle()  # nothing of this pass runs on after the call

    def join(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        """The prefill pass of new sequences that join the running batch (continuous batching): their
        EAMs start empty and are appended after the running rows, whose EAMs are kept."""
        runtime = self._live()
        with self._lock, torch.inference_mode():
            running = runtime.offloader.begin_join(input_ids.shape[0])
            try:
                return self.model(input_ids, **kwargs)
            finally:
                runtime.offloader.end_join(running)

    def keep_rows(self, keep: list[int]) -> None:
        """Continue with only the batch rows `keep` (in that order), e.g. after a server drops finished
        sequences between decode steps; their EAMs follow them."""
        with self._lock:
            self._live().offloader.keep_rows(keep)

    # --- stats and lifetime --------------------------------------------------------------------------
    def stats(self) -> dict[str, object]:
        """Counters since construction or `reset_stats` (definitions in `moeinf.runtime.stats`)."""
        with self._lock:
            return self._live().stats_dict()

    def reset_stats(self) -> None:
        with self._lock:
            self._live().reset_stats()

    @property
    def seq2seq(self) -> bool:
        """True for encoder-decoder models (Switch Transformers): `generate` returns decoder tokens only."""
        return self._live().seq2seq

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (`moeinf.hf.tokenizer.load_tokenizer` over the store's tokenizer files; the
        documented byte-level fallback when the model ships none)."""
        if self._tokenizer is None:
            from .hf.tokenizer import load_tokenizer

            self._tokenizer, _kind = load_tokenizer(self.store.dir)
        return self._tokenizer

    def close(self) -> None:
        """Stop the I/O threads and free the expert slots; the model is unusable afterwards."""
        with self._lock:
            if self._runtime is not None:
                self._runtime.close()
                self._runtime = None

    def __enter__(self) -> MoE:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _live(self) -> Runtime:
        if self._runtime is None:
            raise ConfigError("this MoE is closed; create a new MoE(model_dir, config)")
        return self._runtime
