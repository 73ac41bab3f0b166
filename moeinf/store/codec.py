"""The lossless code of exact bf16 expert blobs on disk: 12 bits a weight instead of 16, bit for bit.

A bf16 weight is sign, 8 exponent bits and 7 mantissa bits; weights (trained or random) take few powers of
two, so each word is stored as its sign|mantissa byte plus a 4-bit code for its exponent (the blob's 15
commonest; the rare others in an escape list). A read-bound fetch moves a quarter fewer bytes from the
drive, and the engine's I/O threads decode each blob in its slot after checking its checksum (AVX2: about
10 GB/s a core). The format is in `csrc/codec.hpp`; this module is the Python side of the same C++ code.

Why a code of our own rather than a general compressor (zstd, lz4): those find no repeated strings in
weights (about 0.9 of the size at best, for a decoder several times slower), while the exponent code gets
0.75 at memory speed, in place, with no second buffer.
"""

from __future__ import annotations

import numpy as np

from moeinf import _engine

CODEC = "bf16-exp4"
"""The name of the code in a store's index (`StoreIndex.codec`)."""
CODECS = (CODEC,)


def bound(nbytes: int) -> int:
    """The most bytes the code of `nbytes` bytes of bf16 words (a multiple of 128) takes."""
    return int(_engine.codec_bound(nbytes // 2))


def encode_into(blob: memoryview | np.ndarray, out: memoryview | np.ndarray) -> int:
    """Code the bf16 words of `blob` (a multiple of 128 bytes) into `out` (at least `bound` bytes);
    returns the bytes written."""
    return int(_engine.codec_encode_into(blob, out))


def encode(blob: memoryview | np.ndarray | bytes) -> bytes:
    """The code of the bf16 words of `blob` (a multiple of 128 bytes)."""
    words = np.frombuffer(blob, dtype=np.uint8)
    out = np.empty(bound(words.size), dtype=np.uint8)
    return out[: encode_into(words, out)].tobytes()


def decode_in_place(buffer: memoryview | bytearray | np.ndarray, size: int,
                    raw_size: int | None = None) -> int:
    """Decode the coded blob in the first `size` bytes of the writable `buffer`, in place; returns the bytes
    of words it decoded to. A malformed blob, or one that does not decode to `raw_size` bytes where given,
    raises ValueError (and leaves `buffer` unchanged)."""
    got = 2 * int(_engine.codec_words(memoryview(buffer)[:size]))
    if raw_size is not None and got != raw_size:
        raise ValueError(f"the coded blob decodes to {got} bytes, expected {raw_size}")
    _engine.codec_decode(buffer, size)
    return got


def decode(coded: bytes | memoryview, raw_size: int) -> bytearray:
    """The `raw_size` bytes the coded blob `coded` decodes to."""
    buffer = bytearray(max(raw_size, len(coded)))
    buffer[: len(coded)] = coded
    decode_in_place(buffer, len(coded), raw_size)
    del buffer[raw_size:]
    return buffer
