"""`MoE`: a HuggingFace MoE model whose experts live in an expert store and are offloaded by moeinf.

    with MoE("path/to/model", OffloadConfig(device_cache="25%")) as model:
        out = model.generate(input_ids, max_new_tokens=32)
        print(model.stats())

The model is a checkpoint directory, a zoo name (`"demo"`) or a HuggingFace id, as on the command line
(`moeinf.hub.resolve_model`).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .builder import Runtime
from .config import ConfigError, OffloadConfig
from .hub import ModelRef, resolve_model
from .kernels import openmp
from .parallel.ep import launch

log = logging.getLogger(__name__)


def with_model_defaults(config: OffloadConfig, ref: ModelRef) -> OffloadConfig:
    """`config` with the defaults of the model `ref` names where it leaves them unset: the store under
    `$MOEINF_CACHE/stores` for zoo and hub models (one store for every command), and the EAMC shipped
    for a zoo model (its look-ahead predictor sits beside it)."""
    changes: dict[str, Any] = {}
    if config.offload_dir is None and ref.store_dir is not None:
        suffix = f"-{config.quant}" if config.quant in ("int8", "int4") else ""
        changes["offload_dir"] = str(ref.store_dir) + suffix
    if config.eamc is None and ref.eamc is not None:
        changes["eamc"] = str(ref.eamc)
    return dataclasses.replace(config, **changes) if changes else config


def pack_store(model_dir: Path, config: OffloadConfig, *, progress: bool = True) -> None:
    """Pack `model_dir`'s store where `config` puts it, when it is not there yet, saying so (logger
    `moeinf.api`, and progress lines through `moeinf.progress`). A location that cannot be written is a
    one-line ConfigError naming what sets it: $MOEINF_CACHE, or the model's directory (--offload-dir)."""
    from .builder import store_plan
    from .store import pack
    from .store.index import INDEX_NAME
    from .zoo import cache_root

    store, quant = store_plan(model_dir, config)
    if (store / INDEX_NAME).is_file():
        return
    try:
        cache = cache_root()
        under_cache = store.resolve().is_relative_to(cache.resolve())
    except OSError:
        under_cache = False
    if under_cache:
        where, fix = (f"under $MOEINF_CACHE ({cache})",
                      "set MOEINF_CACHE to a writable directory, or give offload_dir a writable directory")
    elif config.offload_dir is None:
        where, fix = "beside the model", "give offload_dir a directory on a writable disk"
    else:
        where, fix = "at offload_dir", "give offload_dir a writable directory"
    if store.exists() and not store.is_dir():
        raise ConfigError(f"cannot write the expert store {store} {where}: it exists and is not a directory; "
                          f"{fix}")
    log.warning("packing the expert store %s (first use of this model)", store)
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        pack(model_dir, store, quant=quant, progress=progress)
    except OSError as exc:
        if exc.errno not in _WRITE_ERRORS:  # e.g. the checkpoint has no safetensors: not the store's place
            raise
        reason = exc.strerror or " ".join(str(exc).split())
        raise ConfigError(f"cannot write the expert store {store} {where} ({reason}); {fix}") from None


_WRITE_ERRORS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR}
"""Errors of a place that cannot hold the store (as against a checkpoint that cannot be read)."""


@dataclasses.dataclass
class Usage:
    """Tokens and seconds of the model's forward passes, split into prefill (passes starting sequences:
    their prompt tokens) and decode (passes over a KV cache: one token per row). Every pass yields one
    next token per row, so `generated` counts the tokens the passes produced."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    generated: int = 0

    def as_dict(self) -> dict[str, float]:
        return {
            "tokens": self.generated,
            "prompt_tokens": self.prefill_tokens,
            "prefill_s": self.prefill_s,
            "decode_tokens": self.decode_tokens,
            "decode_s": self.decode_s,
            "prefill_tokens_per_s": self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0,
            "decode_tokens_per_s": self.decode_tokens / self.decode_s if self.decode_s else 0.0,
        }


class _UsageHooks:
    """Forward pre-hook and hook of the model instance that time every pass into a `Usage`."""

    def __init__(self, usage: Usage) -> None:
        self.usage = usage
        self.pass_start = 0.0
        self.pass_rows = 0
        self.pass_prompt: int | None = None  # prompt tokens of a prefill pass; None for a decode pass

    def before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        decoder = kwargs.get("decoder_input_ids")
        rows_of = decoder if isinstance(decoder, torch.Tensor) else ids
        if not isinstance(rows_of, torch.Tensor):
            rows_of = kwargs.get("inputs_embeds")
        self.pass_rows = int(rows_of.shape[0]) if isinstance(rows_of, torch.Tensor) else 0
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        cached = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
        if cached:
            self.pass_prompt = None
        else:
            mask = kwargs.get("attention_mask")
            if isinstance(mask, torch.Tensor) and isinstance(ids, torch.Tensor) and mask.shape == ids.shape:
                self.pass_prompt = int(mask.sum())
            else:
                self.pass_prompt = int(ids.numel()) if isinstance(ids, torch.Tensor) else 0
        self.pass_start = time.perf_counter()

    def after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        logits = getattr(output, "logits", None)
        if isinstance(logits, torch.Tensor) and logits.is_cuda:
            torch.cuda.synchronize(logits.device)  # the pass's seconds, not its launch's
        seconds = time.perf_counter() - self.pass_start
        usage = self.usage
        usage.generated += self.pass_rows
        if self.pass_prompt is None:
            usage.decode_tokens += self.pass_rows
            usage.decode_s += seconds
        else:
            usage.prefill_tokens += self.pass_prompt
            usage.prefill_s += seconds


def measure(model: torch.nn.Module) -> Usage:
    """A `Usage` that the forward passes of this model instance (offloaded or not) keep up to date."""
    usage = Usage()
    hooks = _UsageHooks(usage)
    model.register_forward_pre_hook(hooks.before, with_kwargs=True)
    model.register_forward_hook(hooks.after, with_kwargs=True)
    return usage


@functools.cache
def warn_if_openmp_spins() -> None:
    """Once per process: say how to stop torch's idle OpenMP threads from holding every core, where they
    do (`moeinf.kernels.openmp`; the `moeinf` command sets it itself)."""
    if openmp.spins_long():
        log.warning("torch's OpenMP threads keep every CPU busy between ops, slowing moeinf's I/O and kernel "
                    "threads (several times on a busy machine); set OMP_WAIT_POLICY=PASSIVE in the "
                    "environment before Python starts")


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
        self.ref = getattr(model_dir, "ref", None) or resolve_model(model_dir)
        self.config = with_model_defaults(OffloadConfig.coerce(config), self.ref)
        self.model_dir = self.ref.path
        self._lock = threading.RLock()
        warn_if_openmp_spins()
        pack_store(self.model_dir, self.config)
        self._runtime: Runtime | None = launch(self.model_dir, self.config)
        self.model = self._runtime.model
        self.store = self._runtime.store
        self._vocab = self.model.get_input_embeddings().num_embeddings
        self._tokenizer: Any = None
        self.usage = measure(self.model)

    # --- model calls ---------------------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """`transformers` generate on the offloaded model; the batch's sequences finish with the call."""
        runtime = self._checked(input_ids, "generate")
        with self._lock, torch.inference_mode():
            runtime.offloader.start(input_ids.shape[0])
            try:
                out = self.model.generate(input_ids, **kwargs)
            finally:
                runtime.offloader.finish()
        return out

    def __call__(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        """One forward pass; without a KV cache (`cache`, or `past_key_values` before transformers 5.24)
        the batch starts new sequences."""
        runtime = self._checked(input_ids, "__call__")
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
        runtime = self._checked(input_ids, "join")
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
        """Counters since construction or `reset_stats` (definitions in `moeinf.runtime.stats`), with the
        tokens and speed of every forward pass, however it was called (`Usage`): `tokens` generated,
        `prompt_tokens`, `prefill_tokens_per_s` and `decode_tokens_per_s`."""
        with self._lock:
            return {**self._live().stats_dict(), **self.usage.as_dict()}

    def reset_stats(self) -> None:
        with self._lock:
            self._live().reset_stats()
            for f in dataclasses.fields(Usage):
                setattr(self.usage, f.name, f.default)

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

    def _checked(self, input_ids: Any, method: str) -> Runtime:
        """The live runtime, once `input_ids` are token ids this model can embed: a `TypeError` for what is
        not a [batch, tokens] integer tensor (`_check_ids`), a `ValueError` for no token or an id the
        embedding has no row for (torch would say "index out of range in self", or fail on a reshape)."""
        _check_ids(input_ids, method)
        runtime = self._live()
        if input_ids.shape[1] == 0:
            raise ValueError(f"MoE.{method}: input_ids holds no token (shape {list(input_ids.shape)}); "
                             "give at least one")
        low, high = (int(v) for v in torch.aminmax(input_ids))
        if low < 0 or high >= self._vocab:
            raise ValueError(f"MoE.{method}: token id {low if low < 0 else high} is outside the model's "
                             f"vocabulary of {self._vocab} tokens (ids 0 to {self._vocab - 1})")
        return runtime

    def _live(self) -> Runtime:
        if self._runtime is None:
            raise ConfigError("this MoE is closed; create a new MoE(model_dir, config)")
        return self._runtime


def _check_ids(input_ids: Any, method: str) -> None:
    """A `TypeError` saying what `MoE.<method>` takes, for what is not a [batch, tokens] tensor of integer
    token ids (text, a list of ids, floats): torch would fail further in with an error that names neither."""
    if (isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[0] > 0
            and not input_ids.dtype.is_floating_point and not input_ids.dtype.is_complex):
        return
    got = (f"a tensor of shape {list(input_ids.shape)} ({str(input_ids.dtype).removeprefix('torch.')})"
           if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__)
    raise TypeError(f"MoE.{method} takes input_ids, a [batch, tokens] tensor of token ids such as "
                    f"model.tokenizer(text, return_tensors='pt').input_ids; got {got}")
