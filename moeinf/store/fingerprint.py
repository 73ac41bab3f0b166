"""The model fingerprint: one sha256 that identifies a model's config and weights, cheaply.

It hashes the canonical config.json (without the fields that change when the same model is re-saved),
the sorted (key, dtype, shape) of every checkpoint tensor, and the bytes of the router weights, which
are small and differ between two trainings of the same architecture. It reads headers and routers
only, so it costs milliseconds per GB of checkpoint. A store records the fingerprint of the checkpoint
it was packed from, and `fingerprint(store_dir)` returns that value, so a source directory and its
store share one fingerprint; EAMCs and traces carry it to refuse another model's data.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from ..spec import UnsupportedModelError, spec_for

TRANSIENT_CONFIG_KEYS = frozenset({
    "transformers_version", "_name_or_path", "_commit_hash", "_attn_implementation_autoset",
    # The saving dtype is already in every tensor's dtype below.
    "dtype", "torch_dtype",
})
_CHUNK = 16 << 20


def fingerprint(model_dir: str | Path) -> str:
    """sha256 hex of a HuggingFace checkpoint directory, or the recorded one of a moeinf store."""
    # Imported here: moeinf.store imports this module (pack records the fingerprint).
    from .index import INDEX_NAME, StoreIndex
    from .safetensors_file import FileCache, checkpoint_tensors

    model_dir = Path(model_dir)
    if (model_dir / INDEX_NAME).is_file():
        return StoreIndex.load(model_dir).fingerprint
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; pass a HuggingFace model directory")
    config = json.loads(config_path.read_text())
    canonical = {k: v for k, v in config.items() if k not in TRANSIENT_CONFIG_KEYS}
    spec = spec_for(config.get("model_type", ""))
    tensors = checkpoint_tensors(model_dir)
    digest = hashlib.sha256()
    digest.update(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode())
    for key in sorted(tensors):
        info = tensors[key]
        digest.update(f"\n{key}\0{info.dtype}\0{list(info.shape)}".encode())
    routers = [key for key in sorted(tensors) if re.search(spec.router, spec.rename(key))]
    if not routers:
        if not any(re.search(spec.experts_module + r"\.", spec.rename(key)) for key in tensors):
            raise UnsupportedModelError(
                f"{model_dir} has no MoE layer (no router or expert tensor): its config makes every layer "
                f"dense{_dense_hint(config)}; there is nothing to offload, load it with transformers")
        raise ValueError(f"no tensor of {model_dir} matches the router pattern {spec.router!r} of family "
                         f"{spec.family!r}; fix `router` in moeinf/spec.py")
    buffer = bytearray(_CHUNK)
    with FileCache() as files:
        for key in routers:
            info = tensors[key]
            digest.update(f"\n{key}".encode())
            for start in range(0, info.nbytes, _CHUNK):
                end = min(start + _CHUNK, info.nbytes)
                view = memoryview(buffer)[: end - start]
                files.read(info, view, start, end)
                digest.update(view)
    return digest.hexdigest()


def _dense_hint(config: dict) -> str:
    """Which config field made every layer dense, where it is one of the usual ones."""
    layers = config.get("num_hidden_layers")
    for key in ("first_k_dense_replace", "first_dense_layers", "num_dense_layers"):
        if isinstance(config.get(key), int) and isinstance(layers, int) and config[key] >= layers:
            return f" ({key}={config[key]} >= num_hidden_layers={layers})"
    return ""
