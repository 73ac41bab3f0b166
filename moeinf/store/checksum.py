"""The expert blob checksum ("fletcher64w"), computed with numpy; csrc/checksum.cpp computes the same.

s1 = sum(w_i), s2 = sum((i + 1) * w_i) over little-endian uint64 words, both mod 2^64;
checksum = s1 ^ (s2 * 0x9E3779B97F4A7C15) mod 2^64. Order-sensitive and fast enough to check every read.
"""

from __future__ import annotations

import numpy as np

ALGORITHM = "fletcher64w"
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_BLOCK_WORDS = 1 << 20


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
