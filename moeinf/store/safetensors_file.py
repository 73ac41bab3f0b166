"""Byte-level access to safetensors files: read headers, copy byte ranges, stream-write a file.

Why not `safetensors.safe_open`: it memory-maps the whole shard, and every page a read touches stays
in the process's resident set until the file is closed, so packing a 5 GB shard would cost 5 GB of
RSS. Reading with `os.pread` into our own buffers goes through the page cache instead, which the
kernel reclaims, and keeps the packer's memory bounded by the buffers it holds. The format is small
and stable: an 8-byte little-endian header length, a JSON header mapping each key to its dtype,
shape and `data_offsets` [begin, end) relative to the data section, then the data section.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from .checksum import StreamChecksum

# safetensors dtype code <-> torch dtype name (the names the store index uses).
DTYPES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
CODES: dict[str, str] = {name: code for code, name in DTYPES.items()}
_MAX_HEADER = 100 << 20
_COPY_CHUNK = 64 << 20


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a store dtype name such as "bfloat16"."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def element_size(name: str) -> int:
    return torch.empty((), dtype=torch_dtype(name)).element_size()


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: `path`, absolute byte range [start, end)."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """The tensors of a safetensors file, by key, without reading their data."""
    path = Path(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_HEADER:
            raise ValueError(f"{path} is not a safetensors file (header length {length})")
        header = json.loads(f.read(length))
    data_start = 8 + length
    out: dict[str, TensorInfo] = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        if meta["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {key!r} has dtype {meta['dtype']} that moeinf cannot store")
        begin, end = meta["data_offsets"]
        out[key] = TensorInfo(path, DTYPES[meta["dtype"]], tuple(meta["shape"]), data_start + begin,
                              data_start + end)
    return out


def read_into(fd: int, offset: int, out: memoryview) -> None:
    """Fill `out` with the bytes of the open file `fd` starting at `offset`; short files raise."""
    done = 0
    while done < len(out):
        n = os.preadv(fd, [out[done:]], offset + done)
        if n == 0:
            raise OSError(f"unexpected end of file at offset {offset + done} (fd {fd})")
        done += n


class FileCache:
    """Open read-only file descriptors, one per path, closed together."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def read(self, info: TensorInfo, out: memoryview, start: int = 0, end: int | None = None) -> None:
        """Read bytes [start, end) of the tensor `info` into `out`."""
        end = info.nbytes if end is None else end
        assert len(out) == end - start, (len(out), start, end)
        read_into(self.fd(info.path), info.start + start, out)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> FileCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_streaming(path: Path, tensors: Iterable[tuple[str, TensorInfo]], files: FileCache,
                    metadata: dict[str, str] | None = None) -> int:
    """Write a safetensors file holding `tensors` (new key, source) by copying their bytes in
    chunks of at most 64 MiB, so memory stays bounded whatever the tensor sizes. Returns the file's
    `file_checksum`, computed from the bytes as they are written (no read-back)."""
    items = list(tensors)
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for key, info in items:
        header[key] = {"dtype": CODES[info.dtype], "shape": list(info.shape),
                       "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # readers expect the data section 8-byte aligned
    buffer = bytearray(min(_COPY_CHUNK, max((info.nbytes for _, info in items), default=0)))
    stream = StreamChecksum()
    with open(path, "wb") as out:
        for head in (struct.pack("<Q", len(encoded)), encoded):
            out.write(head)
            stream.update(head)
        for _, info in items:
            for start in range(0, info.nbytes, _COPY_CHUNK):
                end = min(start + _COPY_CHUNK, info.nbytes)
                view = memoryview(buffer)[: end - start]
                files.read(info, view, start, end)
                out.write(view)
                stream.update(view)
        out.flush()
        os.fsync(out.fileno())
    return stream.digest()


def checkpoint_tensors(model_dir: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of a HuggingFace checkpoint directory, by checkpoint key, from the shards named by
    `model.safetensors.index.json` when present, else from every `*.safetensors` file."""
    model_dir = Path(model_dir)
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        weight_map = {}
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {model_dir}; moeinf reads safetensors checkpoints only "
            "(convert a PyTorch .bin checkpoint with `model.save_pretrained(dir)` first)")
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"{index_path} names the shard {path.name}, which is missing")
        for key, info in read_header(path).items():
            if key in tensors:
                raise ValueError(f"tensor {key!r} is in both {tensors[key].path.name} and {path.name}")
            tensors[key] = info
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise ValueError(f"{index_path} lists {len(missing)} tensors absent from the shards, "
                         f"e.g. {missing[0]!r} (in {weight_map[missing[0]]})")
    return tensors
