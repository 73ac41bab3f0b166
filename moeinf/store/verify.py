"""`verify`: re-read every expert blob of a store and check its size and checksum, check every other file
against its whole-file checksum (the dense weights, the config and tokenizer files; the index checks its
own when it is read), and check that the dense weights file is a whole safetensors file (a readable header
whose tensors all lie inside the file, with the byte size their shape and dtype need). Stores packed
before whole-file checksums have none for the dense file: `unchecked` names it."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..engine import checksum
from ..progress import progress_bar
from .checksum import file_checksum
from .codec import decode_in_place
from .index import ExpertEntry, StoreIndex
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
    problems += _check_files(store.dir, store.index)
    blob = np.empty(store.max_blob_size, dtype=np.uint8)
    with progress_bar(store.stored_bytes, unit="B", unit_scale=True, desc="verify", enabled=progress) as bar:
        for file_index, name in enumerate(store.index.files):
            entries = [e for e in store.index.experts if e.file == file_index]
            problems += _verify_file(store.path(file_index), name, entries, blob, bar)
    return problems


def unchecked(store_dir: str | Path) -> list[str]:
    """Files of the store at `store_dir` that `verify` cannot check: packed before they had checksums."""
    return StoreIndex.load(Path(store_dir)).unchecked_files()


def _check_files(store_dir: Path, index: StoreIndex) -> list[Problem]:
    """Every file with a whole-file checksum in the index, read again and compared."""
    problems = []
    for name, expected in (index.file_checksums or {}).items():
        if name == index.dense and not (store_dir / name).is_file():
            continue  # reported by `_check_dense`
        try:
            got = file_checksum(store_dir / name)
        except OSError as exc:
            problems.append(Problem(name, f"cannot read the file ({exc.strerror})"))
            continue
        if got != expected:
            problems.append(Problem(name, "checksum mismatch (corrupted data)"))
    return problems


def _check_dense(path: Path, name: str) -> list[Problem]:
    """The dense weights file's structure, down to the last byte (its bytes: `_check_files`)."""
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
            if end > entry.nbytes or entry.nbytes > entry.memory_size:
                problems.append(_problem(name, entry, f"tensor {tensor_name} ends at {end}, beyond the "
                                                      f"blob's {entry.nbytes} bytes (corrupt index)"))
    return problems


def _problem(name: str, entry: ExpertEntry, message: str) -> Problem:
    return Problem(name, message, entry.layer, entry.expert, entry.offset)


def _verify_file(path: Path, name: str, entries: list[ExpertEntry], blob: np.ndarray,
                 bar: Any) -> list[Problem]:
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
            elif entry.raw_size:
                try:
                    decode_in_place(blob, entry.size, entry.raw_size)
                except ValueError as exc:
                    problems.append(_problem(name, entry, f"the coded blob does not decode ({exc})"))
    finally:
        os.close(fd)
    return problems
