"""The store checksum ("fletcher64w"), computed with numpy; csrc/checksum.cpp computes the same.

s1 = sum(w_i), s2 = sum((i + 1) * w_i) over little-endian uint64 words, both mod 2^64;
checksum = s1 ^ (s2 * 0x9E3779B97F4A7C15) mod 2^64. Order-sensitive and fast enough to check every read.
Expert blobs are checked one by one (`checksum`); the other files of a store as a whole (`file_checksum`:
the file's bytes followed by zeros up to a multiple of 8, read in blocks so memory stays small).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

ALGORITHM = "fletcher64w"
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


_FILE_BLOCK = 8 * 2**20


class StreamChecksum:
    """`file_checksum` of a byte stream fed in pieces of any length (`update`), so a writer checksums what
    it writes as it writes it instead of reading the file back (a 2.6 GB dense file read again from the
    drive when the page cache cannot hold it). Words straddling two pieces are carried over."""

    def __init__(self) -> None:
        self.s1 = np.uint64(0)
        self.s2 = np.uint64(0)
        self.words = 0  # words summed so far
        self.carry = b""  # the bytes after the last whole word

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if self.carry:
            head = self.carry + bytes(view[: 8 - len(self.carry)])
            view = view[8 - len(self.carry) :]
            if len(head) < 8:
                self.carry = head
                return
            self._add(np.frombuffer(head, dtype="<u8"))
            self.carry = b""
        whole = len(view) // 8 * 8
        for start in range(0, whole, _FILE_BLOCK):
            self._add(np.frombuffer(view[start : min(start + _FILE_BLOCK, whole)], dtype="<u8"))
        self.carry = bytes(view[whole:])

    def _add(self, words: np.ndarray) -> None:
        index = np.arange(self.words + 1, self.words + 1 + words.size, dtype=np.uint64)
        with np.errstate(over="ignore"):
            self.s1 += words.sum(dtype=np.uint64)
            self.s2 += (words * index).sum(dtype=np.uint64)
        self.words += words.size

    def digest(self) -> int:
        """The checksum of the bytes so far, zero-padded to a multiple of 8 (the stream can go on)."""
        s1, s2 = self.s1, self.s2
        with np.errstate(over="ignore"):
            if self.carry:
                word = np.frombuffer(self.carry + bytes(8 - len(self.carry)), dtype="<u8")[0]
                s1 += word
                s2 += word * np.uint64(self.words + 1)
            return int(s1 ^ (s2 * _GOLDEN))


def file_checksum(path: str | Path) -> int:
    """The checksum of a whole file, zero-padded to a multiple of 8 bytes, read in 8 MiB blocks."""
    stream = StreamChecksum()
    block = bytearray(_FILE_BLOCK)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(block):
            stream.update(memoryview(block)[:n])
    return stream.digest()


def file_identity(path: str | Path) -> tuple[int, int, int, int]:
    """What changes when a file is replaced or rewritten: device, inode, size, modification time."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def checksum(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """Checksum of a buffer whose size is a multiple of 8 bytes."""
    view = data.reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) else memoryview(data).cast("B")
    if len(view) % 8:
        raise ValueError(f"checksum: {len(view)} bytes is not a multiple of 8")
    stream = StreamChecksum()
    stream.update(view)
    return stream.digest()
