"""What a model argument names, resolved once for every command and for the API.

A model is named in one of three ways, tried in this order:

- a checkpoint directory (what `save_pretrained` writes: config.json and safetensors weights);
- a zoo model that ships with moeinf or is cached by it (`demo`, `full`; `quick` and `tiny` are trained
  on first use), which comes with its EAMC and look-ahead predictor;
- a HuggingFace model id (`org/name`), fetched through `huggingface_hub` into its cache (honouring
  `HF_HUB_CACHE`/`HF_HOME`, `HF_HUB_OFFLINE` and a revision) and read from there.

`resolve_model` returns a `ModelRef`: the local checkpoint directory and the defaults that go with it.
Stores of zoo and hub models are packed under `$MOEINF_CACHE/stores` (never into the package or the hub
cache), so every command and the API find the same store; a checkpoint directory's store sits beside it
(`<dir>.moeinf`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .config import ConfigError

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
"""A hub repo id: `name` or `org/name` (letters, digits, `-`, `_`, `.`)."""
HUB_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken")
"""What a hub snapshot needs: config, weights and tokenizer files (no pickles, no code)."""


class ModelRefError(ConfigError):
    """The model argument names nothing usable; the message says what was tried and what to do."""


@dataclass(frozen=True)
class ModelRef:
    """A resolved model: `path` is a local checkpoint directory."""

    path: Path
    name: str
    """What to call it: the zoo name, the hub id, or the directory's name."""
    kind: str
    """"dir", "zoo" or "hub"."""
    store_dir: Path | None = None
    """Where its store is packed by default (None: `<path>.moeinf` beside the checkpoint)."""
    eamc: Path | None = None
    """The EAMC shipped for this very model (its predictor sits beside it), if any."""


def is_store(path: Path) -> bool:
    from .store.index import INDEX_NAME

    return (path / INDEX_NAME).is_file()


def resolve_model(ref: str | Path, *, revision: str | None = None, progress: bool = True) -> ModelRef:
    """The checkpoint `ref` names: a directory, a zoo model name or a HuggingFace id (see the module)."""
    text = str(ref)
    kind = kind_of(text)
    if revision is not None and kind != "hub":
        what = "a checkpoint directory" if kind == "dir" else "a zoo model"
        raise ModelRefError(f"--revision {revision}: a revision belongs to a HuggingFace id (org/name); "
                            f"{text} is {what}, which has one version")
    if kind == "dir":
        path = checkpoint_dir(Path(text).expanduser(), text)
        variant = zoo_variant(path)
        if variant is not None:  # a zoo model named by its path: the same store and EAMC as by its name
            return zoo_ref(path, variant)
        return ModelRef(path, path.name, "dir")
    if kind == "zoo":
        return zoo_model(text, progress=progress)
    return hub_model(text, revision=revision, progress=progress)


def kind_of(text: str) -> str:
    """"dir" (an existing path), "zoo" or "hub" for what `text` names; a one-line error when none fits."""
    if Path(text).expanduser().exists():
        return "dir"
    from .zoo.train import RECIPES

    if text in RECIPES:
        return "zoo"
    if HUB_ID.match(text) and "/" in text:
        return "hub"
    names = ", ".join(sorted(RECIPES))
    raise ModelRefError(f"{text} does not exist, and it is neither a zoo model ({names}) nor a HuggingFace "
                        "id (org/name); give a checkpoint directory, a zoo name or a hub id")


def checkpoint_dir(path: Path, text: str) -> Path:
    """`path` when it is a checkpoint directory, else a one-line error saying what to give instead."""
    if not path.is_dir():
        raise ModelRefError(f"{text} is a file; give the checkpoint's directory (with config.json)")
    if is_store(path):
        raise ModelRefError(f"{text} is an expert store (written by `moeinf pack`), not a checkpoint; give "
                            "the checkpoint directory it was packed from as the model, and "
                            f"--offload-dir {text}")
    config = path / "config.json"
    if not config.is_file():
        raise ModelRefError(f"{text} has no config.json, so it is not a HuggingFace checkpoint directory; "
                            "give the directory that `save_pretrained` wrote, a zoo name or a hub id")
    try:
        record = json.loads(config.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelRefError(f"{config} is not valid JSON ({exc.msg} at line {exc.lineno} column "
                            f"{exc.colno}); a checkpoint's config.json is what `save_pretrained` writes"
                            ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelRefError(f"cannot read {config} ({exc})") from None
    if not isinstance(record, dict):
        raise ModelRefError(f"{config} holds a JSON {type(record).__name__}, not an object; a checkpoint's "
                            "config.json is what `save_pretrained` writes")
    return path


def zoo_model(variant: str, *, progress: bool = True, retrain: bool = False) -> ModelRef:
    """Zoo `variant` (trained first when neither shipped nor cached; again with `retrain`)."""
    from .zoo import get_model

    return zoo_ref(get_model(variant, progress=progress, retrain=retrain), variant)


def zoo_ref(path: Path, variant: str) -> ModelRef:
    from .zoo import shipped_eamc, store_dir

    eamc = matching_eamc(shipped_eamc(variant), path, variant)
    return ModelRef(path, variant, "zoo", store_dir(path), eamc)


def zoo_variant(path: Path) -> str | None:
    """The variant of a zoo checkpoint directory (its `moeinf-zoo.json` says), else None."""
    import json

    meta = path / "moeinf-zoo.json"
    if not meta.is_file():
        return None
    try:
        variant = json.loads(meta.read_text()).get("variant")
    except (ValueError, OSError, AttributeError):
        return None
    return variant if isinstance(variant, str) else None


def matching_eamc(eamc: Path | None, model: Path, variant: str = "") -> Path | None:
    """`eamc` when it was traced on `model` (a retrained zoo model gets none), else None with a note."""
    if eamc is None:
        return None
    from .store.fingerprint import fingerprint
    from .trace.eamc import EAMC, EAMCMismatchError

    try:
        EAMC.load(eamc, fingerprint=fingerprint(model))
    except EAMCMismatchError:
        log.warning("%s was traced on another %s model than %s (trained elsewhere or retrained); the "
                    "runtime learns expert use online instead", eamc, variant or "", model)
        return None
    return eamc


def hub_cache() -> str | None:
    """The hub cache directory the environment names now (None: the library's default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_model(repo_id: str, *, revision: str | None = None, progress: bool = True) -> ModelRef:
    """`repo_id` from the local hub cache, downloaded first when it is not there and the network is on."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    from .zoo import cache_root

    cache = hub_cache()
    where = cache or "the default hub cache (~/.cache/huggingface/hub)"
    at = f" at revision {revision}" if revision else ""
    fetch = f"`hf download {repo_id}{f' --revision {revision}' if revision else ''}`"
    if not progress:
        disable_progress_bars()
    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                          local_files_only=hub_offline(), allow_patterns=list(HUB_FILES)))
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if hub_offline() else "the hub cannot be reached"
        raise ModelRefError(f"{repo_id}{at} is not in the local HuggingFace cache ({where}) and {why}; "
                            f"fetch it where there is network with {fetch} (same HF_HUB_CACHE), or give a "
                            "checkpoint directory") from None
    except GatedRepoError:
        raise ModelRefError(f"{repo_id} is gated; accept its terms on huggingface.co and log in with "
                            "`hf auth login` (or set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelRefError(f"{repo_id} has no revision {revision}; give a branch, tag or commit "
                            "(--revision)") from None
    except RepositoryNotFoundError:
        raise ModelRefError(f"{repo_id} is not a local directory, and the HuggingFace hub has no such model "
                            "(or it is private: set HF_TOKEN)") from None
    except HfHubHTTPError as exc:
        raise ModelRefError(f"downloading {repo_id} failed ({' '.join(str(exc).split())[:200]}); retry, "
                            f"or fetch it with {fetch}") from None
    finally:
        if not progress:
            enable_progress_bars()
    checkpoint_dir(snapshot, f"{repo_id} ({snapshot})")
    commit = snapshot.name
    store = cache_root() / "stores" / f"{repo_id.replace('/', '--')}-{commit[:16]}"
    return ModelRef(snapshot, repo_id, "hub", store)
