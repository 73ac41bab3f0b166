"""A small MoE trained on the shipped prompt sets, so routing has real structure (no download needed).

`get_model(variant)` returns the directory of a complete checkpoint (transformers `save_pretrained` output
in safetensors plus its tokenizer and `moeinf-zoo.json`, the recipe and training figures):

- the shipped one, `moeinf/zoo/weights/<variant>/`, when the package has it (the full model): nothing
  to train or copy;
- else the cached one in `$MOEINF_CACHE/models/<variant>-v1` (default `~/.cache/moeinf`), trained first
  when the cache has none, or when `retrain=True` (`moeinf demo --retrain`).

A lock file keeps two processes from training the same variant at once, and training writes to a
temporary directory renamed when complete. A cached model trained with another recipe than the current
one is refused, naming `--retrain`, rather than used as if it were current.
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


SHIPPED_ROOT = Path(__file__).parent / "weights"
"""Checkpoints that ship with the package, one directory per variant."""
TRACES_DIR = Path(__file__).parents[2] / "traces"
"""EAMCs of the zoo models in a source checkout (`traces/zoo-<variant>.eamc`)."""


def cache_root() -> Path:
    """`$MOEINF_CACHE` if set, else `~/.cache/moeinf`."""
    env = os.environ.get("MOEINF_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "moeinf"


def model_dir(variant: str, cache_dir: str | Path | None = None) -> Path:
    """Where `variant` is cached (it may not exist yet)."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    return root / "models" / f"{variant}-{CACHE_VERSION}"


def shipped_dir(variant: str) -> Path:
    """Where the package ships `variant` (it may not exist)."""
    return SHIPPED_ROOT / variant


def shipped_eamc(variant: str) -> Path | None:
    """The EAMC built for the shipped `variant`: beside its weights directory (not in it: every
    `*.safetensors` file of a checkpoint directory is read as a weight shard), else in the checkout's
    traces/. Its learned look-ahead predictor sits beside it (`zoo-<variant>.lookahead.safetensors`)."""
    for path in (SHIPPED_ROOT / f"zoo-{variant}.eamc", TRACES_DIR / f"zoo-{variant}.eamc"):
        if path.is_file():
            return path
    return None


def problems(directory: Path, variant: str) -> list[str]:
    """Why `directory` is not a complete zoo checkpoint of the current `variant` recipe (empty when it is)."""
    from dataclasses import asdict

    from .train import RECIPES

    missing = [name for name in REQUIRED_FILES if not (directory / name).is_file()]
    if missing:
        return [f"missing {', '.join(missing)}"]
    meta = json.loads((directory / "moeinf-zoo.json").read_text())
    if meta.get("variant") != variant:
        return [f"moeinf-zoo.json says variant {meta.get('variant')!r}, expected {variant!r}"]
    # A recipe recorded before a field existed held that field's default.
    current = json.loads(json.dumps(asdict(RECIPES[variant]))) if variant in RECIPES else None
    if current is not None and {**current, **meta.get("recipe", {})} != current:
        return ["trained with another recipe than moeinf.zoo.train.RECIPES holds now"]
    return []


def get_model(variant: str = "full", cache_dir: str | Path | None = None, *, retrain: bool = False,
              seed: int = 0, threads: int = 2, progress: bool = True) -> Path:
    """The checkpoint directory of zoo `variant`: the shipped one, else the cached one, trained first if
    absent. `retrain`: train it again into the cache (replacing a cached one), ignoring a shipped one.

    A cached directory that exists but is incomplete or stale raises rather than being retrained
    silently; the error says how to train again.
    """
    from .train import RECIPES, train_model

    if variant not in RECIPES:
        raise ValueError(f"unknown zoo variant {variant!r}; choose one of {sorted(RECIPES)}")
    shipped = shipped_dir(variant)
    if not retrain and shipped.is_dir():
        found = problems(shipped, variant)
        if not found:
            return shipped
        log.warning("ignoring the shipped zoo model %s (%s)", shipped, "; ".join(found))
    target = model_dir(variant, cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists() and not retrain:
            found = problems(target, variant)
            if found:
                raise RuntimeError(f"cached zoo model {target} is unusable ({'; '.join(found)}); train it "
                                   f"again with `moeinf demo --variant {variant} --retrain`")
            return target
        staging = target.parent / f"{target.name}.tmp-{os.getpid()}"
        if staging.exists():
            shutil.rmtree(staging)
        log.warning("training zoo model %r into %s (time budget %.0f min)", variant, target,
                    RECIPES[variant].max_minutes)
        train_model(staging, variant, seed=seed, threads=threads, progress=progress)
        if target.exists():  # --retrain: the old model goes only once the new one is complete
            old = target.parent / f"{target.name}.old-{os.getpid()}"
            target.rename(old)
            shutil.rmtree(old)
        staging.rename(target)
    return target


def store_dir(model: Path) -> Path:
    """Where the expert store of zoo checkpoint `model` is packed: in the cache, keyed by its fingerprint,
    so the shipped model's store is never written into the package and a retrained model gets its own."""
    from ..store.fingerprint import fingerprint

    return cache_root() / "stores" / f"{model.name}-{fingerprint(model)[:16]}"
