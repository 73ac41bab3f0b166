"""`pack`: turn a HuggingFace checkpoint into an expert store (layout in docs/internals.md, "Store").

Streaming: each expert blob is assembled in one reused buffer from byte ranges of the shards, then
checksummed and appended to experts.bin; dense tensors are copied into dense.safetensors in chunks of
at most 64 MiB. Peak memory is therefore the largest expert blob + 64 MiB + the meta-device skeleton,
whatever the model size. Everything is written under a temporary directory next to STORE_DIR, which is
renamed to STORE_DIR only when complete, so an interrupted pack leaves no half store behind; a directory
holding only store files and no index (a store left half-made some other way) is replaced. Every file but
the index and the expert files (whose blobs have checksums of their own) gets a whole-file checksum.

Packing into a store of the same model again does nothing when the store is whole; a damaged one (a
file missing or cut short, or with `verify_existing` any checksum mismatch) is packed again and
replaced. An index too damaged to say which model it holds is refused with what to do.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import queue
import shutil
import threading
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ..disk import shortfall
from ..engine import checksum
from ..progress import progress_bar
from .checksum import ALGORITHM, file_checksum
from .codec import CODECS, encode_into
from .codec import bound as codec_bound
from .fingerprint import fingerprint
from .index import (
    ALIGNMENT,
    DENSE_FILE,
    EXPERTS_FILE,
    INDEX_NAME,
    TENSOR_ALIGNMENT,
    ExpertEntry,
    StoreError,
    StoreIndex,
    TensorEntry,
    align,
)
from .quant import Quantization, quantise_blob, quantised_index
from .safetensors_file import FileCache, write_streaming
from .source import Checkpoint, SourceTensor

logger = logging.getLogger(__name__)

COPIED_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "spiece.model", "vocab.json",
    "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json",
)


def pack(src_dir: str | Path, store_dir: str | Path, *, quant: Quantization | None = None,
         codec: str | None = None, progress: bool = True, verify_existing: bool = False) -> StoreIndex:
    """Pack the checkpoint in `src_dir` into a store at `store_dir` and return its index.

    `quant` quantises the experts (`moeinf/store/quant.py`); None keeps them exact. `codec` ("bf16-exp4",
    `moeinf/store/codec.py`) stores exact bf16 experts losslessly coded, a quarter fewer bytes to read; with
    None, an existing exact store is taken whether coded or not (both read back the same weights).

    A no-op returning the existing index when `store_dir` already holds this model packed this way and
    whole (every file there and as long as the index says; with `verify_existing`, every checksum right
    too), else the store is packed again and replaced. Raises StoreError when it holds another model, the
    same model packed another way, an unreadable index, or files that are no store's.
    """
    src_dir, store_dir = Path(src_dir), Path(store_dir)
    if codec is not None and codec not in CODECS:
        raise ValueError(f"unknown expert codec {codec!r}; choose one of {', '.join(CODECS)}")
    if codec is not None and quant is not None:
        raise ValueError(f"the {codec} codec is for exact bf16 experts, not {quant.scheme} ones: "
                         "pack either quantised or coded")
    model_fingerprint = fingerprint(src_dir)
    existing = _existing_store(src_dir, store_dir, model_fingerprint, quant, codec)
    if existing is not None:
        damage = _damage(store_dir, existing, full=verify_existing)
        if not damage:
            logger.info("%s already holds this model; nothing to pack", store_dir)
            return existing
        logger.warning("%s is damaged (%s); packing the model again to replace it", store_dir, damage)
    checkpoint = Checkpoint.open(src_dir)
    index, layout = _plan(checkpoint, model_fingerprint)
    if codec is not None and index.dtype != "bfloat16":
        raise ValueError(f"{src_dir}: the {codec} codec codes bf16 experts; these are {index.dtype}")
    target = quantised_index(index, quant) if quant is not None else replace(index, codec=codec)
    _remove_stale_partials(store_dir)
    short = shortfall(store_dir, _store_bytes(checkpoint, target, codec), "the store")
    if short:
        raise StoreError(f"{short}; free space or pack elsewhere (--offload-dir)")
    store_dir.parent.mkdir(parents=True, exist_ok=True)
    # Unique per call (two threads may pack at once); mkdir, unlike mkdtemp, honours the umask.
    partial = store_dir.parent / f".{store_dir.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    partial.mkdir()
    try:
        index = _write(checkpoint, index, layout, partial, progress, target, quant, codec)
        _replace(partial, store_dir)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
        # A concurrent pack of the same model may have renamed its store into place first.
        if (store_dir / INDEX_NAME).is_file():
            existing = _existing_store(src_dir, store_dir, model_fingerprint, quant, codec)
            if existing is not None:
                return existing
        raise
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    logger.info("packed %d experts (%.1f MiB) into %s", len(index.experts),
                sum(e.size for e in index.experts) / 2**20, store_dir)
    return index


def _store_bytes(checkpoint: Checkpoint, target: StoreIndex, codec: str | None) -> int:
    """The bytes the store will take: its blobs and the dense weights. Coded blobs count at the fewest
    bytes the code can reach (a sign|mantissa byte and a 4-bit exponent code per word, 3/4 of the exact
    bytes), so the check refuses only a store that cannot fit."""
    experts = sum(e.size for e in target.experts)
    if codec is not None:
        experts = experts * 3 // 4
    return experts + sum(info.nbytes for _, info in checkpoint.dense)


def _replace(partial: Path, store_dir: Path) -> None:
    """Rename the complete `partial` to `store_dir`, moving aside (then deleting) what held the name: an
    empty directory, a damaged store of this model or an abandoned half store (checked by the caller)."""
    if not store_dir.exists():
        os.rename(partial, store_dir)
        return
    old = store_dir.parent / f".{store_dir.name}.replaced-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.rename(store_dir, old)
    try:
        os.rename(partial, store_dir)
    except OSError:
        os.rename(old, store_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _damage(store_dir: Path, index: StoreIndex, *, full: bool) -> str:
    """Why the store of `index` at `store_dir` cannot be used as it is ("" when whole). Cheap checks
    (files present and long enough) always; with `full`, every checksum (`moeinf verify`)."""
    ends: dict[int, int] = {}
    for e in index.experts:
        ends[e.file] = max(ends.get(e.file, 0), e.offset + e.size)
    for file_index, name in enumerate(index.files):
        path = store_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size < ends.get(file_index, 0):
            return f"{name} is cut short"
    if not (store_dir / index.dense).is_file():
        return f"{index.dense} is missing"
    for name in index.file_checksums or {}:
        if not (store_dir / name).is_file():
            return f"{name} is missing"
    if full:
        from .verify import verify

        problems = verify(store_dir)
        if problems:
            return f"{len(problems)} problem(s), such as {problems[0]}"
    return ""


def _abandoned(store_dir: Path) -> bool:
    """True when `store_dir` holds only files a pack writes and no index: a store left half-made."""
    names = {p.name for p in store_dir.iterdir()}
    return bool(names) and INDEX_NAME not in names and names <= {EXPERTS_FILE, DENSE_FILE, *COPIED_FILES}


def _remove_stale_partials(store_dir: Path) -> None:
    """Delete the temporary directories of packs into `store_dir` that were killed (their process is gone)."""
    for path in store_dir.parent.glob(f".{store_dir.name}.partial-*"):
        pid = path.name[len(f".{store_dir.name}.partial-"):].split("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            logger.info("removing %s, left by an interrupted pack", path)
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass  # a live process of another user


def _existing_store(src_dir: Path, store_dir: Path, model_fingerprint: str,
                    quant: Quantization | None, codec: str | None = None) -> StoreIndex | None:
    if not store_dir.exists():
        return None
    if not store_dir.is_dir():
        raise StoreError(f"{store_dir} exists and is not a directory; choose another STORE_DIR")
    if not (store_dir / INDEX_NAME).is_file():
        if _abandoned(store_dir):
            logger.warning("%s holds a half-made store (no index); it will be replaced", store_dir)
        elif any(store_dir.iterdir()):
            raise StoreError(f"{store_dir} is not empty and holds no moeinf store; refusing to overwrite it. "
                             "Choose another STORE_DIR or empty it")
        return None
    try:
        index = StoreIndex.load(store_dir)
    except StoreError as exc:
        raise StoreError(f"{store_dir} holds a damaged store whose index cannot say which model it holds "
                         f"({exc}). Move it away (or delete it) and run `moeinf pack` again, or choose "
                         "another STORE_DIR") from None
    if index.fingerprint != model_fingerprint:
        raise StoreError(
            f"{store_dir} holds a store of another model ({index.model_type}, fingerprint "
            f"{index.fingerprint[:16]}) than {src_dir} ({model_fingerprint[:16]}); refusing to overwrite it. "
            "Choose another STORE_DIR or remove the old store")
    held = Quantization.from_json(index.quant) if index.quant is not None else None
    if held != quant:
        raise StoreError(f"{store_dir} holds an {_describe(held)} store of this model, not the "
                         f"{_describe(quant)} one asked for; choose another STORE_DIR or remove the old "
                         "store")
    if codec is not None and index.codec != codec:
        raise StoreError(f"{store_dir} holds this model with experts {_coded(index.codec)}, not "
                         f"{_coded(codec)} as asked; choose another STORE_DIR or remove the old store")
    return index


def _coded(codec: str | None) -> str:
    return f"coded {codec}" if codec else "not coded"


def _describe(quant: Quantization | None) -> str:
    return quant.describe() if quant is not None else "exact"


def _plan(checkpoint: Checkpoint, model_fingerprint: str) -> tuple[StoreIndex, list[list[SourceTensor]]]:
    """Offsets of every blob and of every tensor inside it, without reading any data."""
    entries: list[ExpertEntry] = []
    layout: list[list[SourceTensor]] = []
    file_offset = 0
    for layer, experts in enumerate(checkpoint.experts):
        for expert, sources in enumerate(experts):
            tensors: dict[str, TensorEntry] = {}
            end = 0
            for source in sources:
                start = align(end, TENSOR_ALIGNMENT)
                tensors[source.name] = TensorEntry(source.dtype, source.shape, start)
                end = start + source.nbytes
            size = align(max(end, 1), ALIGNMENT)
            entries.append(ExpertEntry(layer, expert, 0, file_offset, size, end, 0, tensors))
            layout.append(sources)
            file_offset += size
    _check_consistent(checkpoint, entries)
    config = checkpoint.config
    index = StoreIndex(
        fingerprint=model_fingerprint, model_type=config.model_type, family=checkpoint.spec.family,
        dtype=entries[0].tensors[checkpoint.spec.tensors[0].name].dtype,
        num_layers=len(checkpoint.modules), num_experts=checkpoint.num_experts,
        top_k=checkpoint.spec.top_k(config), modules=checkpoint.modules, experts=entries,
        files=[EXPERTS_FILE], dense=DENSE_FILE, alignment=ALIGNMENT, checksum=ALGORITHM)
    return index, layout


def _check_consistent(checkpoint: Checkpoint, entries: list[ExpertEntry]) -> None:
    first = entries[0]
    for entry in entries:
        for name, tensor in entry.tensors.items():
            reference = first.tensors.get(name)
            if reference is None or (reference.dtype, reference.shape) != (tensor.dtype, tensor.shape):
                module = checkpoint.modules[entry.layer]
                raise ValueError(
                    f"{checkpoint.src_dir}: expert {entry.expert} of {module} has {name} {tensor.dtype}"
                    f"{list(tensor.shape)}, expert 0 of {checkpoint.modules[0]} has "
                    f"{None if reference is None else (reference.dtype, list(reference.shape))}; "
                    "every expert must have the same tensors, shapes and dtype")
        if entry.tensors.keys() != first.tensors.keys():
            module = checkpoint.modules[entry.layer]
            raise ValueError(f"{checkpoint.src_dir}: expert {entry.expert} of {module} has tensors "
                             f"{sorted(entry.tensors)}, expected {sorted(first.tensors)}")


class _BlobWriter:
    """Appends blobs to the experts file on a thread of its own while the caller reads the next ones.

    The caller takes one of `depth` buffers (`take`), fills it and hands it back with `put`; the thread
    writes it, checksums it and returns the buffer to the pool. Reads of the source and writes of the store
    overlap on the drive, and memory stays `depth` blobs whatever the model size. Writes bypass the page
    cache (O_DIRECT: blobs and buffers are page-aligned) where the file system allows it, so a memory cap
    holding the process and its page cache is not filled with dirty pages to write back (and no copy is
    made); elsewhere (tmpfs) they are buffered.

    With `coded`, the thread codes each exact blob (`moeinf/store/codec.py`) before writing it, right after
    the previous one: the coding overlaps the caller's reads instead of following them."""

    def __init__(self, path: Path, size: int, depth: int, bar: Any, aligned: bool,
                 coded: bool = False) -> None:
        self.bar = bar
        self.coded = (np.frombuffer(mmap.mmap(-1, align(codec_bound(size), ALIGNMENT)), dtype=np.uint8)
                      if coded else None)
        self.offset = 0  # where the next coded blob goes
        self.fd, self.direct = _open_for_blobs(path, aligned)
        self.free: queue.Queue[np.ndarray] = queue.Queue()
        for _ in range(depth):  # anonymous maps: page-aligned, as O_DIRECT needs
            self.free.put(np.frombuffer(mmap.mmap(-1, align(size, ALIGNMENT)), dtype=np.uint8))
        self.work: queue.Queue[tuple[np.ndarray, ExpertEntry, int] | None] = queue.Queue()
        self.entries: list[ExpertEntry] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="moeinf-pack-writer", daemon=True)
        self.thread.start()

    def take(self) -> np.ndarray:
        buffer = self.free.get()
        if self.error is not None:
            raise self.error
        return buffer

    def put(self, buffer: np.ndarray, final: ExpertEntry, nbytes: int) -> None:
        self.work.put((buffer, final, nbytes))

    def _run(self) -> None:
        while (item := self.work.get()) is not None:
            buffer, final, nbytes = item
            try:
                if self.error is None:
                    view = memoryview(buffer)[: final.size]
                    if self.coded is not None:
                        used = encode_into(view, self.coded)
                        size = align(used, ALIGNMENT)
                        self.coded[used:size] = 0
                        final = replace(final, offset=self.offset, size=size, raw_size=final.size)
                        self.offset += size
                        view = memoryview(self.coded)[:size]
                    self._write(view, final.offset)
                    # The C++ checksum (5x numpy's); Store.read_blob re-checks with the numpy reference.
                    self.entries.append(replace(final, checksum=checksum(view)))
                    self.bar.update(nbytes)
            except BaseException as exc:  # handed to the caller at its next take() or at finish()
                self.error = exc
            finally:
                self.free.put(buffer)

    def _write(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            try:
                done += os.pwrite(self.fd, view[done:], offset + done)
            except OSError as exc:
                if not self.direct or exc.errno != errno.EINVAL:
                    raise
                # The file system took O_DIRECT at open but refuses its writes: write through the cache.
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False

    def finish(self) -> list[ExpertEntry]:
        self._stop()
        if self.error is not None:
            raise self.error
        os.fsync(self.fd)
        return self.entries

    def _stop(self) -> None:
        self.work.put(None)
        self.thread.join()

    def abandon(self) -> None:
        self._stop()

    def close(self) -> None:
        os.close(self.fd)


def _open_for_blobs(path: Path, aligned: bool) -> tuple[int, bool]:
    """The experts file opened for writing, with O_DIRECT when every blob is page-aligned and the file
    system accepts it: (fd, direct)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if aligned and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o666), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o666), False


WRITE_DEPTH = 4  # blobs in flight between the reading and the writing thread


def _transpose(data: memoryview, stored_shape: tuple[int, ...]) -> None:
    """Transpose, in place, the 2-D tensor of `stored_shape` whose bytes are `data` (any element size)."""
    rows, cols = stored_shape
    item = len(data) // (rows * cols)
    elements = np.frombuffer(data, dtype=np.dtype(f"V{item}")).reshape(rows, cols)
    np.frombuffer(data, dtype=np.dtype(f"V{item}"))[:] = elements.T.copy().reshape(-1)


def _write(checkpoint: Checkpoint, index: StoreIndex, layout: list[list[SourceTensor]], out_dir: Path,
           progress: bool, target: StoreIndex, quant: Quantization | None,
           codec: str | None = None) -> StoreIndex:
    """Write the store planned as `index` (exact blobs, from `layout`), as `target` (the same blobs, or
    their quantised forms when `quant` is given, or coded by `codec`, each then written right after the
    previous one). Reading a blob overlaps writing the previous ones (`_BlobWriter`)."""
    total = sum(e.nbytes for e in index.experts) + sum(info.nbytes for _, info in checkpoint.dense)
    exact_size = max(e.size for e in index.experts)
    blob = np.zeros(exact_size, dtype=np.uint8) if quant is not None else None
    with FileCache() as files, progress_bar(total, unit="B", unit_scale=True, desc="pack",
                                            enabled=progress) as bar:
        aligned = all(e.offset % ALIGNMENT == 0 and e.size % ALIGNMENT == 0 for e in target.experts)
        writer = _BlobWriter(out_dir / EXPERTS_FILE, max(e.size for e in target.experts), WRITE_DEPTH, bar,
                             aligned, coded=codec is not None)
        try:
            try:
                for entry, final, sources in zip(index.experts, target.experts, layout, strict=True):
                    buffer = writer.take()
                    exact = blob if blob is not None else buffer
                    view = memoryview(exact)[: entry.size]
                    exact[: entry.size] = 0  # padding between and after tensors must be zeros
                    for source in sources:
                        cursor = first = entry.tensors[source.name].offset
                        for info, start, end in source.pieces:
                            files.read(info, view[cursor : cursor + end - start], start, end)
                            cursor += end - start
                        if source.stored_shape is not None:
                            _transpose(view[first:cursor], source.stored_shape)
                    if quant is not None:
                        buffer[: final.size] = 0
                        quantise_blob(entry, view, final, memoryview(buffer)[: final.size], quant)
                    writer.put(buffer, final, entry.nbytes)
            except BaseException:
                writer.abandon()
                raise
            entries = writer.finish()
        finally:
            writer.close()
        dense_sum = write_streaming(out_dir / DENSE_FILE, checkpoint.dense, files)
        bar.update(sum(info.nbytes for _, info in checkpoint.dense))
    sums = {DENSE_FILE: dense_sum}
    for name in COPIED_FILES:
        if (checkpoint.src_dir / name).is_file():
            shutil.copyfile(checkpoint.src_dir / name, out_dir / name)
            sums[name] = file_checksum(out_dir / name)
    written = replace(target, experts=entries, file_checksums=sums)
    written.save(out_dir / INDEX_NAME)
    return written
