"""Build a `Backend` from a model directory: offloaded through `moeinf.MoE`, or the plain HF model.

The CLI commands (serve, chat, replay) turn their flags into an `OffloadConfig` and call
`load_backend`; nothing else in the server knows how the model was loaded.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from moeinf.config import OffloadConfig

from .backend import HFBackend

log = logging.getLogger(__name__)

# OffloadConfig fields exposed as flags by serve, chat and replay: flag name -> (field, type, help).
OFFLOAD_FLAGS: dict[str, tuple[str, type, str]] = {
    "--offload-dir": ("offload_dir", str, "expert store (default: <MODEL_DIR>.moeinf, packed on first use)"),
    "--device": ("device", str, "compute device: cpu or cuda"),
    "--device-cache": ("device_cache", str, "compute-tier budget for experts: '4GiB', '25%%' or 0.25"),
    "--host-cache": ("host_cache", str, "host DRAM staging tier budget (0 on a CPU-only machine)"),
    "--eamc": ("eamc", str, "EAMC file from `moeinf trace` (default: learn online)"),
    "--prefetch": ("prefetch", str, "prefetch policy: activation-aware, topk, traced-topk, none"),
    "--eviction": ("eviction", str, "eviction policy: activation-aware, lru, lfu, neighbor"),
    "--io-threads": ("io_threads", int, "I/O threads reading the expert store"),
    "--dtype": ("dtype", str, "auto, float32, bfloat16 or float16"),
}


def add_offload_arguments(parser: argparse.ArgumentParser) -> None:
    """The OffloadConfig flags and --no-offload (run the unmodified HF model, for comparison)."""
    group = parser.add_argument_group("offloading (OffloadConfig fields; defaults from OffloadConfig)")
    for flag, (_, kind, help_text) in OFFLOAD_FLAGS.items():
        group.add_argument(flag, type=kind, default=None, help=help_text)
    group.add_argument(
        "--no-offload",
        action="store_true",
        help="load the whole model with transformers instead of offloading its experts",
    )


def _size(value: str) -> int | float | str:
    """CLI sizes: '0.25' is a fraction, '123' bytes, anything else a size string for OffloadConfig."""
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        return value


def offload_config(args: argparse.Namespace, **overrides: Any) -> OffloadConfig:
    """The OffloadConfig given by the flags (unset flags keep OffloadConfig's defaults)."""
    values: dict[str, Any] = {}
    for flag, (field, _, _) in OFFLOAD_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            values[field] = _size(value) if field in ("device_cache", "host_cache") else value
    values.update(overrides)
    return OffloadConfig.from_dict(values)


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
