"""A small MoE trained here on the shipped prompt sets, so routing has real structure (no download needed).

`get_model(variant)` returns the directory of a cached, complete checkpoint (transformers `save_pretrained`
output in safetensors plus its tokenizer), training it first when the cache has none. The cache lives in
`$MOEINF_CACHE/models/<variant>-v1` (default `~/.cache/moeinf`); a lock file keeps two processes from
training the same variant at once, and training writes to a temporary directory renamed when complete.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_VERSION = "v1"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "moeinf-zoo.json")


def cache_root() -> Path:
    """`$MOEINF_CACHE` if set, else `~/.cache/moeinf`."""
    env = os.environ.get("MOEINF_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "moeinf"


def model_dir(variant: str, cache_dir: str | Path | None = None) -> Path:
    """Where `variant` is cached (it may not exist yet)."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    return root / "models" / f"{variant}-{CACHE_VERSION}"


def problems(directory: Path, variant: str) -> list[str]:
    """Why `directory` is not a complete zoo checkpoint of `variant` (empty when it is)."""
    missing = [name for name in REQUIRED_FILES if not (directory / name).is_file()]
    if missing:
        return [f"missing {', '.join(missing)}"]
    meta = json.loads((directory / "moeinf-zoo.json").read_text())
    if meta.get("variant") != variant:
        return [f"moeinf-zoo.json says variant {meta.get('variant')!r}, expected {variant!r}"]
    return []


def get_model(variant: str = "full", cache_dir: str | Path | None = None, *, seed: int = 0,
              threads: int = 2, progress: bool = True) -> Path:
    """The cached checkpoint directory of zoo `variant`, trained (and cached) first if absent.

    A directory that exists but is incomplete raises rather than being retrained silently: delete it
    (the error names it) to train again.
    """
    from .train import RECIPES, train_model

    if variant not in RECIPES:
        raise ValueError(f"unknown zoo variant {variant!r}; choose one of {sorted(RECIPES)}")
    target = model_dir(variant, cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            found = problems(target, variant)
            if found:
                raise RuntimeError(f"cached zoo model {target} is incomplete ({'; '.join(found)}); "
                                   "delete that directory to train it again")
            return target
        staging = target.parent / f"{target.name}.tmp-{os.getpid()}"
        if staging.exists():
            shutil.rmtree(staging)
        log.warning("zoo model %r is not cached: training it into %s (time budget %.0f min)", variant,
                    target, RECIPES[variant].max_minutes)
        train_model(staging, variant, seed=seed, threads=threads, progress=progress)
        staging.rename(target)
    return target
