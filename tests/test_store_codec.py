"""The lossless bf16 code of expert blobs (`moeinf/store/codec.py`, csrc/codec.cpp): every word round-trips
on both decoders, in place, malformed blobs are refused before anything is written; a coded store reads
back the exact store's blobs (plain reads, the engine, `verify`) and the runtime over it computes what HF
computes, bit for bit."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from moeinf.store import Store, StoreError, pack
from moeinf.store.codec import CODEC, bound, decode, decode_in_place, encode, encode_into
from moeinf.store.verify import verify

engine = pytest.importorskip("moeinf.engine", reason="moeinf.engine (the C++ I/O engine) is not built")
_engine = pytest.importorskip("moeinf._engine", reason="moeinf._engine is not built")


@pytest.fixture(params=[True, False], ids=["avx2", "portable"])
def decoder(request: pytest.FixtureRequest):
    """Run a test on the AVX2 decoder (where the CPU has it) and on the portable one."""
    _engine.codec_set_avx2(request.param)
    if request.param and not _engine.codec_avx2():
        pytest.skip("this CPU has no AVX2")
    yield request.param
    _engine.codec_set_avx2(True)


def gaussian_words(n: int, seed: int = 0, std: float = 0.02) -> np.ndarray:
    values = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * std
    return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).copy()


def round_trip(words: np.ndarray) -> tuple[np.ndarray, int]:
    coded = encode(words)
    return np.frombuffer(decode(coded, words.nbytes), dtype=np.uint16), len(coded)


def test_every_bf16_word_round_trips(decoder: bool) -> None:
    words = np.arange(1 << 16, dtype=np.uint16)  # every sign, exponent (NaN, inf, subnormal) and mantissa
    np.random.default_rng(0).shuffle(words)
    got, _ = round_trip(words)
    assert np.array_equal(got, words)


def test_weights_take_three_quarters_and_round_trip(decoder: bool) -> None:
    words = gaussian_words(64 * 5000)
    got, size = round_trip(words)
    assert np.array_equal(got, words)
    assert size / words.nbytes < 0.76  # 12 bits a word, a header and a few escapes
    # a blob of a single exponent, and one of exponents spread over all 256 values
    for words in (np.full(4096, 0x3F80, dtype=np.uint16),
                  np.random.default_rng(1).integers(0, 1 << 16, 64 * 301, dtype=np.uint16)):
        got, _ = round_trip(words)
        assert np.array_equal(got, words)


@pytest.mark.parametrize("escapes", [0, 7, 300, 5000])
def test_decodes_in_place_whatever_the_escape_list(escapes: int, decoder: bool) -> None:
    """The blocks the escape list and header sit on are decoded from a copy: with none, few or many
    escapes, the words come out right in the one buffer."""
    words = gaussian_words(64 * 400, seed=escapes)
    rng = np.random.default_rng(escapes)
    rare = rng.choice(words.size, escapes, replace=False)
    # exponents far from the weights' range, spread over 100 values so that few reach the table
    words[rare] = (words[rare] & 0x807F) | (rng.integers(1, 101, escapes).astype(np.uint16) << 7)
    coded = encode(words)
    table = np.frombuffer(coded[24:39], dtype=np.uint8)
    expected = np.count_nonzero(~np.isin((words >> 7) & 0xFF, table))
    assert int.from_bytes(coded[16:24], "little") == expected >= 0.8 * escapes
    buffer = bytearray(max(words.nbytes, len(coded)))  # 5,000 escapes make the code longer than the words
    buffer[: len(coded)] = coded
    assert decode_in_place(buffer, len(coded)) == words.nbytes
    assert np.array_equal(np.frombuffer(buffer, dtype=np.uint16)[: words.size], words)


def test_encode_into_a_buffer_matches_encode() -> None:
    words = gaussian_words(64 * 64)
    out = np.zeros(bound(words.nbytes), dtype=np.uint8)
    used = encode_into(words, out)
    assert bytes(out[:used]) == encode(words)
    with pytest.raises(ValueError, match="multiple of 128"):
        encode(words[:100])
    with pytest.raises(ValueError, match="output buffer"):
        encode_into(words, np.zeros(16, dtype=np.uint8))


def test_malformed_blobs_are_refused_before_writing(decoder: bool) -> None:
    words = np.random.default_rng(2).integers(0, 1 << 16, 64 * 64, dtype=np.uint16)  # many escapes
    coded = bytearray(encode(words))
    assert int.from_bytes(coded[16:24], "little") > 0

    def refused(blob: bytes | bytearray, match: str, capacity: int = words.nbytes) -> None:
        buffer = bytearray(max(capacity, len(blob)))
        buffer[: len(blob)] = blob
        before = bytes(buffer)
        with pytest.raises(ValueError, match=match):
            decode_in_place(buffer, len(blob))
        assert bytes(buffer) == before

    refused(b"NOPE" + bytes(coded[4:]), "no MXC1 header")
    refused(coded[: len(coded) - 96], "needs")  # cut short
    past = bytearray(coded)
    past[64:68] = (10**6).to_bytes(4, "little")  # the escape's position beyond the last word
    refused(past, "past its last word")
    weights = encode(gaussian_words(64 * 64))
    refused(weights, "do not fit", capacity=len(weights))  # a buffer too small for the decoded words


# --- a coded store -------------------------------------------------------------------------------------
WIDE = {"hidden_size": 256, "moe_intermediate_size": 512}
"""Experts of 768 KiB: big enough that the 4 KiB padding does not hide the code's saving."""


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Store, Store]:
    from moeinf.hf.tiny import save_tiny

    root = tmp_path_factory.mktemp("codec")
    src = save_tiny("qwen3_moe", root / "model", dtype="bfloat16", **WIDE)
    pack(src, root / "exact", progress=False)
    pack(src, root / "coded", codec=CODEC, progress=False)
    return Store(root / "exact"), Store(root / "coded")


def test_coded_store_holds_the_same_blobs_in_fewer_bytes(stores: tuple[Store, Store]) -> None:
    exact, coded = stores
    assert coded.index.codec == CODEC and exact.index.codec is None
    assert "codec" not in json.loads((exact.dir / "moeinf-store.json").read_text())  # exact index unchanged
    assert coded.stored_bytes < 0.77 * exact.stored_bytes
    assert coded.expert_bytes == exact.expert_bytes and coded.max_blob_size == exact.max_blob_size
    for entry in exact.index.experts:
        assert coded.read_blob(entry.layer, entry.expert) == exact.read_blob(entry.layer, entry.expert)
    assert verify(coded.dir) == []


def test_engine_decodes_coded_blobs_and_checks_them_as_stored(stores: tuple[Store, Store],
                                                              tmp_path: Path) -> None:
    exact, coded = stores
    with engine.Engine.from_store(coded, num_slots=3) as io:
        for entry in coded.index.experts:
            blob = io.wait(entry.layer, entry.expert, timeout=30)
            assert len(blob) == entry.raw_size
            assert bytes(blob) == bytes(exact.read_blob(entry.layer, entry.expert))
            io.release(entry.layer, entry.expert)
        stats = io.stats()
    assert stats["bytes_read"] == coded.stored_bytes
    assert stats["bytes_decoded"] == coded.expert_bytes
    shutil.copytree(coded.dir, tmp_path / "store")
    damaged = Store(tmp_path / "store")
    entry = damaged.entry(1, 3)
    with open(damaged.path(0), "r+b") as f:
        f.seek(entry.offset + 200)
        f.write(b"\x5a" * 8)
    with engine.Engine.from_store(damaged, num_slots=2) as io:
        with pytest.raises(engine.EngineError, match=r"layer 1, expert 3\): checksum mismatch"):
            io.wait(1, 3, timeout=30)
        assert io.wait(1, 2, timeout=30) is not None
    problems = verify(damaged.dir)
    assert [(p.layer, p.expert) for p in problems] == [(1, 3)]
    with pytest.raises(StoreError, match="checksum mismatch"):
        damaged.read_blob(1, 3)


def test_engine_reports_a_blob_that_does_not_decode(stores: tuple[Store, Store]) -> None:
    """A blob whose checksum holds but whose code is wrong (checksums off) fails its read, not the engine."""
    _, coded = stores
    entry = coded.entry(0, 0)
    with engine.Engine([coded.path(0)], coded.max_blob_size + 4096, 3, verify=False) as io:
        io.add(0, 0, 0, entry.offset, entry.size, entry.checksum, entry.raw_size + 4096)  # says more words
        io.add(0, 1, 0, entry.offset + 4096, entry.size, entry.checksum, entry.raw_size)  # not a blob's start
        io.add(0, 2, 0, entry.offset, entry.size, entry.checksum, entry.raw_size)
        with pytest.raises(engine.EngineError, match=r"expert 0\): the coded blob decodes to"):
            io.wait(0, 0, timeout=30)
        with pytest.raises(engine.EngineError, match=r"expert 1\): not a coded blob"):
            io.wait(0, 1, timeout=30)
        assert len(io.wait(0, 2, timeout=30)) == entry.raw_size


def test_pack_refuses_mixing_codes(stores: tuple[Store, Store], tmp_path: Path) -> None:
    exact, coded = stores
    from moeinf.store.quant import Quantization

    src = exact.dir.parent / "model"
    with pytest.raises(StoreError, match="not coded"):
        pack(src, exact.dir, codec=CODEC, progress=False)
    assert pack(src, coded.dir, progress=False).codec == CODEC  # an exact store, coded or not, is taken
    with pytest.raises(ValueError, match="either quantised or coded"):
        pack(src, tmp_path / "q", codec=CODEC, quant=Quantization.of("int8", None), progress=False)
    with pytest.raises(ValueError, match="unknown expert codec"):
        pack(src, tmp_path / "z", codec="zstd", progress=False)


def test_pack_command_compresses(stores: tuple[Store, Store], tmp_path: Path, capsys) -> None:
    from moeinf.cli import main

    src = stores[0].dir.parent / "model"
    assert main(["pack", str(src), "--offload-dir", str(tmp_path / "s"), "--compress", "--json",
                 "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["codec"] == CODEC and summary["stored_bytes"] < summary["expert_bytes"]
    assert main(["pack", str(src), "--compress", "--quant", "int8"]) == 2
    assert "--compress" in capsys.readouterr().err


def test_runtime_over_a_coded_store_equals_hf(tmp_path: Path) -> None:
    from moeinf.bench.exact import compare, prepare

    case = prepare("qwen3_moe-top8", "bfloat16", tmp_path, 24, sizes=WIDE)
    pack(case.model_dir, tmp_path / "coded", codec=CODEC, progress=False)
    coded_case = dataclasses.replace(case, store_dir=tmp_path / "coded")
    row = compare(coded_case, "min", "lookahead", "fitted", 24)
    assert row["misses"] > 0  # the smallest cache read coded blobs on demand
    assert row["tokens_equal"] and row["logits_equal"], row

    # the runtime counts the bytes its reads move from the drive (coded), while slots hold decoded blobs
    from moeinf import MoE, OffloadConfig
    from moeinf.bench.exact import cache_size, greedy

    store = Store(tmp_path / "coded")
    config = OffloadConfig(offload_dir=str(store.dir), device_cache=cache_size(coded_case, "min"))
    with MoE(case.model_dir, config) as moe:
        greedy(moe.generate, case.inputs, 8)
        stats = moe.stats()
    sizes = [e.size for e in store.index.experts]
    assert stats["reads"] > 0
    assert stats["reads"] * min(sizes) <= stats["bytes_read"] <= stats["reads"] * max(sizes)
    assert max(sizes) < min(e.raw_size for e in store.index.experts)
