"""`Store`: a packed expert store opened for reading (layout in docs/internals.md, "Store")."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from .checksum import checksum, file_checksum, file_identity
from .codec import CODECS, decode_in_place
from .index import ExpertEntry, StoreError, StoreIndex
from .safetensors_file import read_into, torch_dtype

_checked: dict[tuple[int, int, int, int], int] = {}
"""Files whose checksum this process has computed, by `file_identity`: each is read once per process."""
_checked_lock = threading.Lock()


def check_file(path: Path, expected: int, store_dir: Path) -> None:
    """Raise StoreError unless the file at `path` has checksum `expected`; computed once per process for
    an unchanged file (another process, or a rewritten file, computes it again)."""
    try:
        identity = file_identity(path)
        with _checked_lock:
            known = _checked.get(identity)
        if known is None:
            known = file_checksum(path)
            with _checked_lock:
                _checked[identity] = known
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror}; run `moeinf verify {store_dir}`") from exc
    if known != expected:
        raise StoreError(f"checksum mismatch in {path} (corrupted data); `moeinf pack SRC_DIR {store_dir}` "
                         "repairs the store (`moeinf verify` lists every damaged file)")


class Store:
    """An expert store: its index, the blob of each (layer, expert), views of a blob as tensors, and
    the dense weights. Reading blobs into a pool is the engine's job; `read_expert` is a plain read for
    tools and tests."""

    def __init__(self, store_dir: str | Path) -> None:
        self.dir = Path(store_dir)
        self.index = StoreIndex.load(self.dir)
        if self.index.codec is not None and self.index.codec not in CODECS:
            raise StoreError(f"{self.dir} codes its experts as {self.index.codec!r}, which this moeinf does "
                             f"not read (it reads {', '.join(CODECS)}); upgrade moeinf or re-pack")
        self._entries = {(e.layer, e.expert): e for e in self.index.experts}
        if len(self._entries) != len(self.index.experts):
            raise StoreError(f"the index of {self.dir} lists an expert twice; re-run `moeinf pack`")
        self._dtypes = {name: torch_dtype(t.dtype) for name, t in self.index.experts[0].tensors.items()}

    @property
    def fingerprint(self) -> str:
        return self.index.fingerprint

    @property
    def expert_bytes(self) -> int:
        """Total size of all expert blobs in memory (padding included; decoded where the store codes them):
        what caching every expert takes."""
        return sum(e.memory_size for e in self.index.experts)

    @property
    def stored_bytes(self) -> int:
        """Total on-disk size of all expert blobs (padding included)."""
        return sum(e.size for e in self.index.experts)

    @property
    def max_blob_size(self) -> int:
        """The largest padded blob in memory: the slot size a pool needs."""
        return max(max(e.size, e.memory_size) for e in self.index.experts)

    def path(self, file_index: int) -> Path:
        return self.dir / self.index.files[file_index]

    def entry(self, layer: int, expert: int) -> ExpertEntry:
        try:
            return self._entries[(layer, expert)]
        except KeyError:
            raise KeyError(f"no expert ({layer}, {expert}) in {self.dir}: it has {self.index.num_layers} MoE "
                           f"layers of {self.index.num_experts} experts") from None

    def tensors(self, layer: int, expert: int, buffer: object) -> dict[str, torch.Tensor]:
        """Zero-copy tensors of expert (layer, expert) over `buffer`, which holds its blob from byte 0.

        The tensors alias the buffer: they are valid while it is, and must not outlive an engine slot
        after `release`. The buffer must be writable (torch cannot view read-only memory).
        """
        return entry_tensors(self.entry(layer, expert), buffer, self._dtypes)

    def read_blob(self, layer: int, expert: int, *, verify: bool = True) -> bytearray:
        """The padded blob of (layer, expert) as in memory, read with a plain pread; checksum-checked by
        default (over the bytes as stored), then decoded if the store codes its blobs."""
        entry = self.entry(layer, expert)
        path = self.path(entry.file)
        blob = bytearray(max(entry.size, entry.memory_size))
        self._read_stored(entry, path, layer, expert, blob, verify)
        if entry.raw_size:
            try:
                decode_in_place(blob, entry.size, entry.raw_size)
            except ValueError as exc:
                raise StoreError(f"expert ({layer}, {expert}) in {path} at offset {entry.offset} does not "
                                 f"decode: {exc}; run `moeinf verify {self.dir}` and re-pack") from None
            del blob[entry.raw_size:]
        return blob

    def _read_stored(self, entry: ExpertEntry, path: Path, layer: int, expert: int, blob: bytearray,
                     verify: bool) -> None:
        """Read the `entry.size` bytes of the blob as stored into the front of `blob`; check their
        checksum."""
        fd = os.open(path, os.O_RDONLY)
        try:
            with memoryview(blob) as whole, whole[: entry.size] as view:
                read_into(fd, entry.offset, view)
        except OSError as exc:
            raise StoreError(f"cannot read expert ({layer}, {expert}) from {path} at offset {entry.offset}: "
                             f"{exc}; run `moeinf verify {self.dir}`") from exc
        finally:
            os.close(fd)
        if verify and checksum(memoryview(blob)[: entry.size]) != entry.checksum:
            raise StoreError(f"checksum mismatch for expert ({layer}, {expert}) in {path} at offset "
                             f"{entry.offset}; run `moeinf verify {self.dir}` and re-pack")

    def read_expert(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """The tensors of (layer, expert) in a fresh buffer (a plain, checksum-checked read)."""
        return self.tensors(layer, expert, self.read_blob(layer, expert))

    def load_dense(self) -> dict[str, torch.Tensor]:
        """Every non-expert weight, by runtime key."""
        from safetensors.torch import load_file

        path = self.dir / self.index.dense
        if not path.is_file():
            raise StoreError(f"{path} is missing; re-run `moeinf pack` into a new STORE_DIR")
        self.check_file(self.index.dense)
        return load_file(path)

    def check_file(self, name: str) -> None:
        """Check the whole-file checksum of `name` (once per process); a store packed before whole-file
        checksums has none to check."""
        sums = self.index.file_checksums
        if sums is not None and name in sums:
            check_file(self.dir / name, sums[name], self.dir)

    def __repr__(self) -> str:
        return (f"Store({str(self.dir)!r}, {self.index.model_type}, {self.index.num_layers}x"
                f"{self.index.num_experts} experts, {self.expert_bytes / 2**20:.1f} MiB)")


def entry_tensors(entry: ExpertEntry, buffer: object,
                  dtypes: dict[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    """Zero-copy tensors of the blob of `entry` held in `buffer` from byte 0 (see `Store.tensors`);
    `dtypes` caches the torch dtype of each tensor name."""
    view = memoryview(buffer).cast("B")  # type: ignore[arg-type]
    if len(view) < entry.nbytes:
        raise ValueError(f"buffer of {len(view)} bytes is smaller than expert ({entry.layer}, "
                         f"{entry.expert}) ({entry.nbytes} bytes)")
    if view.readonly:
        raise ValueError("Store.tensors needs a writable buffer (torch cannot view read-only memory)")
    out: dict[str, torch.Tensor] = {}
    for name, t in entry.tensors.items():
        numel = 1
        for dim in t.shape:
            numel *= dim
        dtype = dtypes[name] if dtypes is not None else torch_dtype(t.dtype)
        flat = torch.frombuffer(view, dtype=dtype, count=numel, offset=t.offset)
        out[name] = flat.view(t.shape)
    return out
