"""The slot pool is page-locked (mlock); over the memlock limit it stays pageable, says so once, and works."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moeinf.engine import ALIGNMENT, Engine, EngineError, checksum

CHILD = """
import json, logging, resource, sys
import numpy as np
from moeinf.engine import Engine, checksum
logging.basicConfig(level=logging.WARNING)
resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, 64 << 10))
path, size = sys.argv[1], int(sys.argv[2])
blob = np.fromfile(path, dtype=np.uint8)
with Engine([path], size, 4, **json.loads(sys.argv[3])) as engine:
    engine.add(0, 0, 0, 0, size, checksum(blob))
    ok = bytes(engine.wait(0, 0, timeout=30)) == blob.tobytes()
    print(engine.stats()["pool_locked"], ok)
"""


def test_the_pool_is_page_locked_and_registrable(tmp_path: Path) -> None:
    path = tmp_path / "experts.bin"
    path.write_bytes(np.ones(ALIGNMENT, dtype=np.uint8).tobytes())
    with Engine([path], ALIGNMENT, 2) as engine:  # 8 KiB: within any default memlock limit
        assert engine.stats()["pool_locked"] and engine.stats()["lock_memory"]
        [(address, size)] = engine.regions()
        assert address % ALIGNMENT == 0 and size == 2 * ALIGNMENT
    with Engine([path], ALIGNMENT, 2, lock_memory=False) as engine:
        assert not engine.stats()["pool_locked"]


def run_over_the_limit(tmp_path: Path, options: str) -> subprocess.CompletedProcess[str]:
    size = 64 * ALIGNMENT  # a 1 MiB pool against a 64 KiB limit
    path = tmp_path / "experts.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    command = [sys.executable, "-c", CHILD, str(path), str(size), options]
    if os.geteuid() == 0:
        # root passes any memlock limit with CAP_IPC_LOCK: drop it from the child's bounding set.
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: cannot drop CAP_IPC_LOCK")
        command = ["setpriv", "--bounding-set=-ipc_lock", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)


def test_over_the_memlock_limit_the_pool_stays_pageable_with_one_warning(tmp_path: Path) -> None:
    child = run_over_the_limit(tmp_path, "{}")
    assert child.stdout.split() == ["False", "True"]  # not locked, and the read is still right
    warnings = [line for line in child.stderr.splitlines() if "could not be page-locked" in line]
    assert len(warnings) == 1 and "64 KiB" in warnings[0] and "ulimit -l" in warnings[0]


def test_lock_memory_false_asks_for_no_lock_and_no_warning(tmp_path: Path) -> None:
    child = run_over_the_limit(tmp_path, '{"lock_memory": false}')
    assert child.stdout.split() == ["False", "True"] and "page-locked" not in child.stderr


def test_chunks_summed_by_four_threads_verify_the_whole_blob(tmp_path: Path) -> None:
    path = tmp_path / "experts.bin"
    data = np.random.default_rng(1).integers(0, 256, 8 * ALIGNMENT, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    with Engine([path], 8 * ALIGNMENT, 1, chunk_bytes=ALIGNMENT, io_threads=4) as engine:
        engine.add(0, 0, 0, 0, 8 * ALIGNMENT, checksum(data))
        assert bytes(engine.wait(0, 0, timeout=30)) == data.tobytes()


@pytest.mark.parametrize("size", [8, 56, 64, 72, 4096, 3 * 4096 + 64, 1 << 20])
def test_the_engine_checksum_is_the_store_format_checksum(size: int) -> None:
    """The C++ (vectorised) checksum equals the numpy reference of the store format, for every tail."""
    from moeinf.store.checksum import checksum as reference

    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    assert checksum(data) == reference(data)



def test_several_reads_in_flight_each_verify_and_a_corrupted_last_chunk_is_refused(tmp_path: Path) -> None:
    """Four threads read three blobs at once in 64 KiB chunks (chunks of one blob in parallel, into
    slots that do not start on a huge-page boundary); each is verified whole, and a blob with one
    corrupted byte in its last chunk is refused and gives its slot back."""
    size = (2 << 20) + ALIGNMENT
    path = tmp_path / "experts.bin"
    data = np.random.default_rng(2).integers(0, 256, 4 * size, dtype=np.uint8)
    sums = [checksum(data[i * size : (i + 1) * size]) for i in range(4)]
    corrupted = data.copy()
    corrupted[4 * size - 100] ^= 0x40  # expert 3's last chunk
    path.write_bytes(corrupted.tobytes())
    with Engine([path], size, 3, chunk_bytes=64 << 10, io_threads=4) as engine:
        for e in range(4):
            engine.add(0, e, 0, e * size, size, sums[e])
        for e in range(3):
            engine.submit(0, e, 1.0)
        views = [engine.wait(0, e, timeout=30) for e in range(3)]
        for e, view in enumerate(views):
            assert bytes(view) == data[e * size : (e + 1) * size].tobytes()
        assert engine.stats()["bytes_verified"] >= 3 * size
        engine.release(0, 0)
        with pytest.raises(EngineError, match="checksum mismatch"):
            engine.wait(0, 3, timeout=30)
        assert engine.free_slots() == 1  # the failed read gave its slot back
