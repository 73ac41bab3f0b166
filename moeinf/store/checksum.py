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
_BLOCK_WORDS = 1 << 20


_FILE_BLOCK = 8 * 2**20


def file_checksum(path: str | Path) -> int:
    """The checksum of a whole file, zero-padded to a multiple of 8 bytes, read in 8 MiB blocks."""
    s1 = np.uint64(0)
    s2 = np.uint64(0)
    block = bytearray(_FILE_BLOCK)
    start = 0  # words before this block
    with open(path, "rb", buffering=0) as f, np.errstate(over="ignore"):
        while True:
            n = f.readinto(block)
            if not n:
                break
            padded = -(-n // 8) * 8
            block[n:padded] = bytes(padded - n)
            words = np.frombuffer(block, dtype="<u8", count=padded // 8)
            index = np.arange(start + 1, start + 1 + words.size, dtype=np.uint64)
            s1 += words.sum(dtype=np.uint64)
            s2 += (words * index).sum(dtype=np.uint64)
            start += words.size
            if n < len(block) and padded != n:
                break  # the zero padding ends the file
        return int(s1 ^ (s2 * _GOLDEN))


def file_identity(path: str | Path) -> tuple[int, int, int, int]:
    """What changes when a file is replaced or rewritten: device, inode, size, modification time."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def checksum(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """Checksum of a buffer whose size is a multiple of 8 bytes."""
    words = np.frombuffer(memoryview(data).cast("B"), dtype="<u8") if not isinstance(data, np.ndarray) else (
        data.reshape(-1).view(np.uint8).view("<u8")
    )
    s1 = np.uint64(0)
    s2 = np.uint64(0)
    with np.errstate(over="ignore"):
        for start in range(0, words.size, _BLOCK_WORDS):
            block = words[start : start + _BLOCK_WORDS]
            index = np.arange(start + 1, start + 1 + block.size, dtype=np.uint64)
            s1 += block.sum(dtype=np.uint64)
            s2 += (block * index).sum(dtype=np.uint64)
        return int(s1 ^ (s2 * _GOLDEN))
