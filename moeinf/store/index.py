"""The store index (`moeinf-store.json`): what is where in an expert store, per docs/internals.md."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .checksum import checksum

FORMAT = "moeinf-store"
VERSION = 1
INDEX_NAME = "moeinf-store.json"
EXPERTS_FILE = "experts.bin"
DENSE_FILE = "dense.safetensors"
ALIGNMENT = 4096
"""Blob alignment and size granularity, so blobs can be read with O_DIRECT."""
TENSOR_ALIGNMENT = 64
"""Offset granularity of tensors inside a blob (cache lines, SIMD loads)."""


class StoreError(RuntimeError):
    """A store is missing, corrupt, of another format version or of another model."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of an expert blob: `offset` is relative to the start of the blob."""

    dtype: str
    shape: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class ExpertEntry:
    """One expert's blob: `size` is the padded on-disk size, `nbytes` the end of its last tensor (offsets
    are in the blob as it is in memory). `raw_size` > 0: the blob is stored coded (`StoreIndex.codec`,
    `moeinf/store/codec.py`) in `size` bytes and decodes to `raw_size` (padded) bytes; `checksum` is over
    the bytes as stored."""

    layer: int
    expert: int
    file: int
    offset: int
    size: int
    nbytes: int
    checksum: int
    tensors: dict[str, TensorEntry]
    raw_size: int = 0

    @property
    def memory_size(self) -> int:
        """The bytes the blob takes in memory (a slot): decoded if coded."""
        return self.raw_size or self.size


@dataclass(frozen=True)
class StoreIndex:
    """The parsed `moeinf-store.json`."""

    fingerprint: str
    model_type: str
    family: str
    dtype: str
    num_layers: int
    num_experts: int
    top_k: int
    modules: list[str]
    experts: list[ExpertEntry]
    files: list[str] = field(default_factory=lambda: [EXPERTS_FILE])
    dense: str = DENSE_FILE
    alignment: int = ALIGNMENT
    checksum: str = "fletcher64w"
    format: str = FORMAT
    version: int = VERSION
    quant: dict[str, Any] | None = None
    """Quantised experts (`moeinf/store/quant.py`): scheme, group size, layout; None = exact."""
    codec: str | None = None
    """How expert blobs are coded on disk (`moeinf/store/codec.py`: "bf16-exp4"); None = as in memory."""
    file_checksums: dict[str, int] | None = None
    """`file_checksum` of every file of the store but the expert files (their blobs have their own) and
    the index (which has `index_checksum`): the dense weights and the copied config and tokenizer files.
    None in stores packed before it existed: those files are then unchecked (`unchecked_files`)."""

    def unchecked_files(self) -> list[str]:
        """Files of the store that have no checksum (stores packed by an older moeinf)."""
        return [self.dense] if self.file_checksums is None else []

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("quant", "codec", "file_checksums"):
            if out[name] is None:
                del out[name]  # an exact store's index is unchanged by the quantisation and codec features
        # Put the header fields first so a person opening the file sees them before the expert list.
        experts = out.pop("experts")
        for entry in experts:
            if not entry["raw_size"]:
                del entry["raw_size"]
            entry["tensors"] = {name: dict(t, shape=list(t["shape"])) for name, t in entry["tensors"].items()}
        return {"format": out.pop("format"), "version": out.pop("version"), **out, "experts": experts}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StoreIndex:
        experts = [
            ExpertEntry(**{**e, "tensors": {name: TensorEntry(t["dtype"], tuple(t["shape"]), t["offset"])
                                           for name, t in e["tensors"].items()}})
            for e in data["experts"]
        ]
        return cls(**{**data, "experts": experts})

    def save(self, path: Path) -> None:
        """Write the index with `index_checksum`, the checksum of its own text without that field."""
        body = self.to_json()
        text = json.dumps({**body, INDEX_CHECKSUM: _text_checksum(body)}, indent=1)
        with open(path, "w") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())

    @classmethod
    def load(cls, store_dir: Path) -> StoreIndex:
        """Read and check the index of `store_dir`; errors name the directory and the fix."""
        path = store_dir / INDEX_NAME
        redo = "pack the model again into a new directory with `moeinf pack SRC_DIR NEW_STORE_DIR`"
        if not path.is_file():
            raise StoreError(f"{store_dir} is not a moeinf store ({INDEX_NAME} is missing): give the "
                             "STORE_DIR that `moeinf pack` wrote")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StoreError(f"the index {path} is unreadable ({exc}); {redo}") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise StoreError(f"{path} is not a moeinf store index; {redo}")
        if data.get("version") != VERSION:
            raise StoreError(f"the store {store_dir} has format version {data.get('version')}, this moeinf "
                             f"reads version {VERSION}; {redo}")
        if INDEX_CHECKSUM in data:  # absent from indexes written before it existed
            stated = data.pop(INDEX_CHECKSUM)
            if stated != _text_checksum(data):
                raise StoreError(f"the index {path} is corrupt (its checksum does not match its contents); "
                                 f"{redo}")
        try:
            index = cls.from_json(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"the index {path} is corrupt ({exc!r}); {redo}") from exc
        if not index.experts or len(index.experts) != index.num_layers * index.num_experts:
            raise StoreError(f"the index {path} lists {len(index.experts)} experts, expected "
                             f"{index.num_layers} x {index.num_experts}; {redo}")
        return index


INDEX_CHECKSUM = "index_checksum"


def _text_checksum(body: dict[str, Any]) -> int:
    """The checksum of the index's JSON text (as `save` writes it) without `index_checksum`: any byte
    changed in the file either breaks the JSON or changes this text."""
    data = json.dumps(body, indent=1).encode()
    return checksum(data + bytes(-len(data) % 8))


def align(value: int, alignment: int) -> int:
    """`value` rounded up to a multiple of `alignment`."""
    return -(-value // alignment) * alignment
