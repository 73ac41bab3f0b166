"""Read errors reach the failed key's waiters as EngineError naming the file and the expert; the engine
keeps serving other keys, and a later submit retries. Also the O_DIRECT / buffered I/O modes."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from moeinf.engine import ALIGNMENT, Engine, EngineError, checksum

SIZE = 2 * ALIGNMENT


def write_blobs(path: Path, count: int, seed: int = 0) -> list[np.ndarray]:
    data = np.random.default_rng(seed).integers(0, 256, size=count * SIZE, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    return [data[i * SIZE : (i + 1) * SIZE] for i in range(count)]


def register(engine: Engine, blobs: list[np.ndarray], file: int = 0, layer: int = 0) -> None:
    for expert, blob in enumerate(blobs):
        engine.add(layer, expert, file, expert * SIZE, SIZE, checksum(blob))


def assert_served(engine: Engine, layer: int, expert: int, blob: np.ndarray) -> None:
    view = engine.wait(layer, expert, timeout=30)
    assert np.array_equal(np.frombuffer(view, dtype=np.uint8), blob)


def test_checksum_mismatch_fails_that_key_only_and_resubmit_retries(tmp_path: Path) -> None:
    path = tmp_path / "experts.bin"
    blobs = write_blobs(path, 3)
    corrupted = bytearray(path.read_bytes())
    corrupted[SIZE + 100] ^= 0xFF  # a flipped byte in expert 1
    path.write_bytes(bytes(corrupted))
    with Engine([path], SIZE, 2) as engine:
        register(engine, blobs)
        with pytest.raises(EngineError, match=r"layer 0, expert 1\).*checksum mismatch") as info:
            engine.wait(0, 1, timeout=30)
        assert str(path) in str(info.value) and isinstance(info.value, RuntimeError)
        with pytest.raises(EngineError, match="checksum mismatch"):
            engine.wait(0, 1, timeout=30)  # stays failed until submitted again
        assert_served(engine, 0, 0, blobs[0])
        assert_served(engine, 0, 2, blobs[2])  # the failed read gave its slot back
        stats = engine.stats()
        assert stats["failures"] == 1 and engine.state(0, 1) == "failed"
        path.write_bytes(b"".join(b.tobytes() for b in blobs))  # repaired
        engine.release(0, 0)
        engine.submit(0, 1, 0.5)
        assert_served(engine, 0, 1, blobs[1])


def test_verify_false_skips_the_checksum(tmp_path: Path) -> None:
    path = tmp_path / "experts.bin"
    blobs = write_blobs(path, 1)
    with Engine([path], SIZE, 1, verify=False) as engine:
        engine.add(0, 0, 0, 0, SIZE, 12345)
        assert_served(engine, 0, 0, blobs[0])


def test_truncated_file_is_a_short_read_naming_file_and_expert(tmp_path: Path) -> None:
    path = tmp_path / "experts.bin"
    blobs = write_blobs(path, 3)
    with open(path, "r+b") as f:
        f.truncate(2 * SIZE + ALIGNMENT + 100)  # expert 2 loses most of its last page
    with Engine([path], SIZE, 2) as engine:
        register(engine, blobs)
        with pytest.raises(EngineError, match=r"layer 0, expert 2\).*short read") as info:
            engine.wait(0, 2, timeout=30)
        assert str(path) in str(info.value)
        assert_served(engine, 0, 1, blobs[1])
        assert_served(engine, 0, 0, blobs[0])


def test_missing_file_fails_its_keys_and_works_once_it_appears(tmp_path: Path) -> None:
    good, missing = tmp_path / "a.bin", tmp_path / "b.bin"
    blobs_a = write_blobs(good, 2, seed=1)
    with Engine([good, missing], SIZE, 2) as engine:
        register(engine, blobs_a, file=0, layer=0)
        blobs_b = [np.full(SIZE, 7, dtype=np.uint8)]
        register(engine, blobs_b, file=1, layer=1)
        with pytest.raises(EngineError, match=r"layer 1, expert 0\).*No such file") as info:
            engine.wait(1, 0, timeout=30)
        assert str(missing) in str(info.value)
        assert_served(engine, 0, 1, blobs_a[1])
        missing.write_bytes(blobs_b[0].tobytes())
        engine.submit(1, 0, 0.5)
        assert_served(engine, 1, 0, blobs_b[0])


def _tmpfs_refuses_direct_io(directory: Path) -> bool:
    probe = directory / "probe"
    probe.write_bytes(b"\0" * ALIGNMENT)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return True
    finally:
        probe.unlink()
    return False


@pytest.fixture
def shm_dir(tmp_path: Path):
    root = Path("/dev/shm")
    if not root.is_dir() or not os.access(root, os.W_OK):
        pytest.skip("no writable /dev/shm")
    directory = root / f"moeinf-test-{os.getpid()}-{tmp_path.name}"
    directory.mkdir()
    yield directory
    for p in directory.iterdir():
        p.unlink()
    directory.rmdir()


def test_tmpfs_is_read_directly_or_through_the_visible_buffered_fallback(
        shm_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Linux >= 6.6 tmpfs accepts O_DIRECT; older kernels refuse it with EINVAL and the engine falls back.
    path = shm_dir / "experts.bin"
    blobs = write_blobs(path, 2)
    refused = _tmpfs_refuses_direct_io(shm_dir)
    with caplog.at_level(logging.WARNING, logger="moeinf.engine"), Engine([path], SIZE, 2) as engine:
        register(engine, blobs)
        assert_served(engine, 0, 1, blobs[1])
        assert engine.stats()["direct_io"] is (not refused)
    assert ("O_DIRECT is refused" in caplog.text) is refused


def test_buffered_reads_when_direct_io_is_off(tmp_path: Path) -> None:
    path = tmp_path / "experts.bin"
    blobs = write_blobs(path, 2)
    with Engine([path], SIZE, 2, direct_io=False) as engine:
        register(engine, blobs)
        assert_served(engine, 0, 0, blobs[0])
        assert engine.stats()["direct_io"] is False
    with Engine([path], SIZE, 2) as engine:
        assert engine.stats()["direct_io"] is True
