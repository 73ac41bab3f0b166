"""Build a `Backend` from a model directory: offloaded through `moeinf.MoE`, or the plain HF model.

The CLI commands (serve, chat, replay) turn their flags into an `OffloadConfig`
(`moeinf.commands.options`) and call `load_backend`; nothing else in the server knows how the model
was loaded.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from moeinf.config import OffloadConfig

from .backend import HFBackend

log = logging.getLogger(__name__)


def load_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer of `model_dir` through moeinf's loader (which has a byte-level fallback)."""
    from moeinf.hf.tokenizer import load_tokenizer as load

    tokenizer, kind = load(model_dir)
    log.info("tokenizer of %s: %s", model_dir, kind)
    return tokenizer


def load_backend(
    model_dir: str | Path, config: OffloadConfig | None, *, name: str | None = None
) -> HFBackend:
    """An offloaded backend (`config` given) or the plain transformers model (`config` None)."""
    model_dir = Path(model_dir)
    name = name or model_dir.name
    tokenizer = load_tokenizer(model_dir)
    if config is None:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        return HFBackend(model, tokenizer, name=name)
    from moeinf.api import MoE

    moe = MoE(model_dir, config)
    return HFBackend(
        moe.model,
        tokenizer,
        name=name,
        forward=moe,
        prefill=moe.join,
        stats_fn=moe.stats,
        close_fn=moe.close,
        on_rows_kept=moe.keep_rows,
        device=config.device,
    )
