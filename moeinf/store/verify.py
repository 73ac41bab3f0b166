"""`verify`: re-read every expert blob of a store and check its size and checksum, and check that the dense
weights file is a whole safetensors file (a readable header whose tensors all lie inside the file, with the
byte size their shape and dtype need)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..engine import checksum
from .index import ExpertEntry
from .reader import Store
from .safetensors_file import element_size, read_header, read_into


@dataclass(frozen=True)
class Problem:
    """One defect of a store; `layer`/`expert` are None for a file that is not an expert blob."""

    file: str
    message: str
    layer: int | None = None
    expert: int | None = None
    offset: int | None = None

    def __str__(self) -> str:
        if self.layer is None:
            return f"{self.file}: {self.message}"
        return f"expert ({self.layer}, {self.expert}) in {self.file} at offset {self.offset}: {self.message}"


def verify(store_dir: str | Path, *, progress: bool = False) -> list[Problem]:
    """Every problem found in the store at `store_dir`; empty when all blobs and files are good.

    An unreadable index raises StoreError instead (nothing can be checked without it).
    """
    store = Store(store_dir)
    problems = _check_layout(store) + _check_dense(store.dir / store.index.dense, store.index.dense)
    blob = np.empty(store.max_blob_size, dtype=np.uint8)
    with tqdm(total=store.expert_bytes, unit="B", unit_scale=True, desc="verify",
              disable=not progress) as bar:
        for file_index, name in enumerate(store.index.files):
            entries = [e for e in store.index.experts if e.file == file_index]
            problems += _verify_file(store.path(file_index), name, entries, blob, bar)
    return problems


def _check_dense(path: Path, name: str) -> list[Problem]:
    """The dense weights file has no checksum in the index: check its structure down to the last byte."""
    try:
        tensors = read_header(path)
        file_size = path.stat().st_size
    except (OSError, ValueError) as exc:
        return [Problem(name, f"unreadable dense weights ({exc})")]
    problems = []
    for key, info in tensors.items():
        need = element_size(info.dtype) * math.prod(info.shape)
        if info.nbytes != need:
            problems.append(Problem(name, f"tensor {key} has {info.nbytes} bytes but its shape "
                                          f"{list(info.shape)} of {info.dtype} needs {need} (bad header)"))
    cut = [key for key, info in tensors.items() if info.end > file_size]
    if cut:
        end = max(info.end for info in tensors.values())
        problems.append(Problem(name, f"the file has {file_size} bytes but its tensors need {end}; "
                                      f"{len(cut)} tensor(s) such as {cut[0]} are cut off (truncated)"))
    return problems


def _check_layout(store: Store) -> list[Problem]:
    """Index consistency: aligned, non-overlapping blobs whose tensors fit inside them."""
    problems = []
    alignment = store.index.alignment
    ends: dict[int, int] = {}
    for entry in sorted(store.index.experts, key=lambda e: (e.file, e.offset)):
        name = store.index.files[entry.file]
        if entry.offset % alignment or entry.size % alignment:
            problems.append(_problem(name, entry, f"blob offset or size {entry.size} not a multiple of "
                                                  f"{alignment} (corrupt index)"))
        if entry.offset < ends.get(entry.file, 0):
            problems.append(_problem(name, entry, "blob overlaps the previous one (corrupt index)"))
        ends[entry.file] = entry.offset + entry.size
        for tensor_name, t in entry.tensors.items():
            end = t.offset + element_size(t.dtype) * math.prod(t.shape)
            if end > entry.nbytes or entry.nbytes > entry.size:
                problems.append(_problem(name, entry, f"tensor {tensor_name} ends at {end}, beyond the "
                                                      f"blob's {entry.nbytes} bytes (corrupt index)"))
    return problems


def _problem(name: str, entry: ExpertEntry, message: str) -> Problem:
    return Problem(name, message, entry.layer, entry.expert, entry.offset)


def _verify_file(path: Path, name: str, entries: list[ExpertEntry], blob: np.ndarray,
                 bar: tqdm) -> list[Problem]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        bar.update(sum(e.size for e in entries))
        return [_problem(name, e, f"cannot open the file ({exc.strerror})") for e in entries]
    problems = []
    try:
        file_size = os.fstat(fd).st_size
        for entry in entries:
            bar.update(entry.size)
            if entry.offset + entry.size > file_size:
                problems.append(_problem(name, entry, f"the file ends at {file_size}, before the blob end "
                                               f"{entry.offset + entry.size} (truncated)"))
                continue
            view = blob[: entry.size]
            read_into(fd, entry.offset, memoryview(view))
            if checksum(memoryview(view)) != entry.checksum:
                problems.append(_problem(name, entry, "checksum mismatch (corrupted data)"))
    finally:
        os.close(fd)
    return problems
