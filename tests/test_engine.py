"""The engine's queue, pool and threads, on small blob files written by each test (no model)."""

from __future__ import annotations

import _thread
import random
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from waiting import until

from moeinf.engine import ALIGNMENT, MAX_PRIORITY, Engine, checksum

BLOB = 4 * ALIGNMENT


class Blobs:
    """`count` random blobs of `size` bytes, back to back in one file, as layer-0 experts 0..count-1."""

    def __init__(self, path: Path, count: int, size: int = BLOB, seed: int = 0) -> None:
        self.path, self.size = path, size
        self.data = np.random.default_rng(seed).integers(0, 256, size=count * size, dtype=np.uint8)
        path.write_bytes(self.data.tobytes())

    def blob(self, expert: int) -> np.ndarray:
        return self.data[expert * self.size : (expert + 1) * self.size]

    def engine(self, num_slots: int, **options: object) -> Engine:
        engine = Engine([self.path], self.size, num_slots, **options)  # type: ignore[arg-type]
        for e in range(len(self.data) // self.size):
            engine.add(0, e, 0, e * self.size, self.size, checksum(self.blob(e)))
        return engine

    def check(self, engine: Engine, expert: int, timeout: float | None = 30.0) -> None:
        view = engine.wait(0, expert, timeout=timeout)
        assert np.array_equal(np.frombuffer(view, dtype=np.uint8), self.blob(expert)), f"expert {expert}"


@pytest.fixture
def blobs(tmp_path: Path) -> Blobs:
    return Blobs(tmp_path / "experts.bin", count=16)


def test_wait_returns_a_zero_copy_view_of_the_file_bytes(blobs: Blobs) -> None:
    with blobs.engine(num_slots=4) as engine:
        view = engine.wait(0, 3)
        tensor = torch.frombuffer(view, dtype=torch.uint8)
        assert torch.equal(tensor, torch.from_numpy(blobs.blob(3).copy()))
        again = torch.frombuffer(engine.wait(0, 3), dtype=torch.uint8)
        assert again.data_ptr() == tensor.data_ptr(), "a second wait on a resident key must not copy"
        assert again.data_ptr() % ALIGNMENT == 0
        assert engine.stats()["hits"] == 1


def test_queue_order_follows_priority_then_arrival_and_resubmit_moves_a_key(blobs: Blobs) -> None:
    # One I/O thread: reads complete in queue order (several threads overlap them).
    with blobs.engine(num_slots=16, paused=True, io_threads=1) as engine:
        for expert, priority in [(0, 0.1), (1, 0.5), (2, 0.3), (3, 0.5), (4, 0.2)]:
            engine.submit(0, expert, priority)
        assert engine.queued() == [(0, 1), (0, 3), (0, 2), (0, 4), (0, 0)]
        engine.submit(0, 0, 0.9)  # re-prioritise: remove + re-insert
        engine.submit(0, 1, 0.05)
        engine.submit(0, 4, 0.3)  # same priority as expert 2: goes behind it
        expected = [(0, 0), (0, 3), (0, 2), (0, 4), (0, 1)]
        assert engine.queued() == expected
        engine.resume()
        for expert in range(5):
            blobs.check(engine, expert)
        assert engine.completed() == expected


@pytest.mark.parametrize("verify", [True, False])
def test_every_byte_read_is_verified_and_its_cpu_counted(tmp_path: Path, verify: bool) -> None:
    many = Blobs(tmp_path / "many.bin", count=4, size=64 * ALIGNMENT)
    with many.engine(num_slots=4, chunk_bytes=4 * ALIGNMENT, io_threads=2, verify=verify) as engine:
        for expert in range(4):
            engine.submit(0, expert, 0.5)
        for expert in range(4):
            many.check(engine, expert)
        stats = engine.stats()
        assert stats["bytes_read"] == 4 * many.size
        assert stats["bytes_verified"] == (4 * many.size if verify else 0)
        assert (stats["verify_cpu_s"] > 0) is verify


def test_a_key_queued_in_flight_or_resident_is_read_once(tmp_path: Path) -> None:
    big = Blobs(tmp_path / "big.bin", count=2, size=256 * ALIGNMENT)
    with big.engine(num_slots=2, chunk_bytes=ALIGNMENT, paused=True) as engine:
        for _ in range(3):
            engine.submit(0, 0, 0.5)
        assert engine.queued() == [(0, 0)]
        engine.resume()
        until(lambda: engine.state(0, 0) != "queued", "the read to start")
        engine.submit(0, 0, 0.7)  # in flight (or already done): must not start a second read
        engine.submit(0, 0, 0.2)
        big.check(engine, 0)
        engine.submit(0, 0, 0.9)  # resident: no-op
        assert engine.queued() == []
        stats = engine.stats()
        assert stats["bytes_read"] == big.size
        assert stats["fetches_prefetch"] + stats["fetches_demand"] == 1


def test_cancel_drops_only_queued_reads(blobs: Blobs) -> None:
    with blobs.engine(num_slots=4, paused=True) as engine:
        engine.submit(0, 0, 0.5)
        engine.submit(0, 1, 0.4)
        assert engine.cancel(0, 0) is True
        assert engine.cancel(0, 0) is False
        assert engine.queued() == [(0, 1)]
        engine.resume()
        blobs.check(engine, 1)
        assert engine.cancel(0, 1) is False  # resident
        assert engine.state(0, 0) == "idle"
        assert engine.stats()["cancels"] == 1
        assert engine.stats()["bytes_read"] == blobs.size


def test_wait_on_a_never_submitted_key_fetches_it_on_demand(blobs: Blobs) -> None:
    with blobs.engine(num_slots=4) as engine:
        blobs.check(engine, 7)
        stats = engine.stats()
        assert (stats["fetches_demand"], stats["fetches_prefetch"], stats["hits"]) == (1, 0, 0)
        assert stats["demand_p50_ms"] >= 0 and np.isnan(stats["prefetch_p50_ms"])
        engine.release(0, 7)
        assert not engine.is_resident(0, 7) and engine.free_slots() == 4
        engine.reset_stats()
        assert engine.stats()["fetches_demand"] == 0 and engine.completed() == []


@pytest.mark.parametrize("io_threads", [1, 4])
def test_demand_fetch_jumps_every_queued_prefetch(blobs: Blobs, io_threads: int) -> None:
    # One slot: a read starts only once it holds the slot, so reads land in the order the threads take them
    # from the queue, whatever the scheduler does with the threads. With free slots, reads taken after the
    # demand by other threads can land before it on a loaded 2-core machine (8 of them once in CI).
    with blobs.engine(num_slots=1, paused=True, io_threads=io_threads) as engine:
        for expert in range(15):
            engine.submit(0, expert, 1.0 - expert / 100)
        engine.submit(0, 15, MAX_PRIORITY)
        assert engine.queued()[0] == (0, 15)
        engine.resume()
        order = [15, *range(15)]  # read in submission order the demand would land last
        for expert in order:
            blobs.check(engine, expert)
            engine.release(0, expert)
        assert engine.completed() == [(0, expert) for expert in order]
        assert engine.stats()["fetches_demand"] == 1


@pytest.mark.parametrize("io_threads", [1, 2])
def test_demand_fetch_preempts_a_read_in_progress(tmp_path: Path, io_threads: int) -> None:
    # A long prefetch read in 4 KiB chunks; the demand must finish while the prefetch is still unfinished.
    # With two threads both read chunks of the same blob in parallel, then both switch to the demand.
    files = Blobs(tmp_path / "experts.bin", count=2, size=2048 * ALIGNMENT)
    with files.engine(num_slots=2, chunk_bytes=ALIGNMENT, io_threads=io_threads) as engine:
        engine.submit(0, 0, 0.5)

        def reading() -> bool:
            state = engine.state(0, 0)
            assert state in ("queued", "reading")
            return state == "reading"

        until(reading, "the prefetch read to start")
        files.check(engine, 1)
        assert engine.completed() == [(0, 1)]
        assert engine.state(0, 0) in ("queued", "reading")
        files.check(engine, 0)  # resumed in its own slot, bytes intact
        stats = engine.stats()
        assert stats["preemptions"] >= 1
        assert stats["bytes_read"] == 2 * files.size


def test_cancel_of_a_paused_partly_read_blob_returns_its_slot(tmp_path: Path) -> None:
    files = Blobs(tmp_path / "experts.bin", count=1, size=1024 * ALIGNMENT)
    with files.engine(num_slots=1, chunk_bytes=ALIGNMENT) as engine:
        engine.submit(0, 0, 0.5)
        until(lambda: engine.state(0, 0) != "queued", "the read to start")
        engine.pause()  # stops after the chunk in flight: partly read, queued, holding the slot
        until(lambda: engine.state(0, 0) != "reading", "the chunk in flight to finish")
        if engine.state(0, 0) == "queued":
            assert engine.free_slots() == 0
            assert engine.cancel(0, 0) is True
        else:  # the whole blob was read before the pause
            engine.release(0, 0)
        assert engine.state(0, 0) == "idle"  # no chunk in flight: nothing holds the slot
        assert engine.free_slots() == 1
        engine.resume()
        files.check(engine, 0)


def test_full_pool_applies_back_pressure_and_wait_times_out(blobs: Blobs) -> None:
    with blobs.engine(num_slots=2) as engine:
        blobs.check(engine, 0)
        blobs.check(engine, 1)
        engine.submit(0, 3, 0.5)
        with pytest.raises(TimeoutError, match="num_slots"):
            engine.wait(0, 2, timeout=0.2)
        assert engine.state(0, 3) == "queued" and engine.free_slots() == 0
        blobs.check(engine, 0)  # resident data untouched
        blobs.check(engine, 1)
        engine.release(0, 0)
        blobs.check(engine, 2)  # the demand takes the freed slot first
        engine.release(0, 1)
        blobs.check(engine, 3)
        assert sorted(engine.resident()) == [(0, 2), (0, 3)]


def test_release_of_a_read_in_progress_drops_it_and_frees_the_slot(tmp_path: Path) -> None:
    files = Blobs(tmp_path / "experts.bin", count=1, size=1024 * ALIGNMENT)
    with files.engine(num_slots=1, chunk_bytes=ALIGNMENT) as engine:
        engine.submit(0, 0, 0.5)
        engine.release(0, 0)  # queued or reading: dropped either way
        engine.wait(0, 0, timeout=30)
        engine.release(0, 0)
        assert engine.state(0, 0) == "idle" and engine.free_slots() == 1


def test_concurrent_submit_wait_release_from_several_threads(tmp_path: Path) -> None:
    files = Blobs(tmp_path / "experts.bin", count=24)
    errors: list[BaseException] = []

    def worker(engine: Engine, own: list[int], seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(60):
                prefetch = rng.sample(own, 2)
                for expert in prefetch:
                    engine.submit(0, expert, rng.random())
                expert = rng.choice(own)
                files.check(engine, expert)
                for key in {expert, *prefetch}:
                    engine.release(0, key)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    # 4 threads x 2 unreleased prefetches leave slots for every demand: no test-made deadlock.
    with files.engine(num_slots=12, io_threads=2) as engine:
        threads = [threading.Thread(target=worker, args=(engine, list(range(t, 24, 4)), t)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        # Reads released while in flight finish into their slot, then give it back.
        keys = range(24)
        until(lambda: not any(engine.state(0, k) == "reading" for k in keys),
              "the released reads to finish")
        assert [engine.state(0, k) for k in keys] == ["idle"] * 24
        assert engine.free_slots() == 12


def test_close_wakes_waiters_and_buffers_outlive_the_engine(blobs: Blobs) -> None:
    engine = blobs.engine(num_slots=1, paused=True)
    outcome: list[BaseException] = []

    def blocked() -> None:
        try:
            engine.wait(0, 1)
        except RuntimeError as exc:
            outcome.append(exc)

    engine.resume()
    kept = engine.wait(0, 0)
    engine.pause()
    thread = threading.Thread(target=blocked)
    thread.start()
    until(lambda: engine.stats()["waits_blocked"] >= 2, "the second waiter to block")
    engine.close()
    thread.join()
    assert len(outcome) == 1 and "closed" in str(outcome[0])
    assert np.array_equal(np.frombuffer(kept, dtype=np.uint8), blobs.blob(0))
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(0, 0, 0.5)


def test_ctrl_c_interrupts_a_blocked_wait(blobs: Blobs) -> None:
    # Python's own SIGINT handler (a server test may have left uvicorn's): interrupt_main then raises
    # KeyboardInterrupt in the blocked wait instead of calling another handler.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupted_wait(blobs)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted_wait(blobs: Blobs) -> None:
    with blobs.engine(num_slots=1, paused=True) as engine:
        timer = threading.Timer(0.05, _thread.interrupt_main)
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            engine.wait(0, 0)
        timer.join()
        engine.resume()
        blobs.check(engine, 0)  # the interrupted wait left the engine usable


def test_bad_arguments_name_the_knob(blobs: Blobs) -> None:
    with blobs.engine(num_slots=1) as engine:
        with pytest.raises(KeyError, match="never registered"):
            engine.submit(5, 0, 0.5)
        with pytest.raises(ValueError, match="raise slot_bytes"):
            engine.add(1, 0, 0, 0, 2 * blobs.size, 0)
        with pytest.raises(ValueError, match="multiples of 4096"):
            engine.add(1, 0, 0, 100, blobs.size, 0)
        with pytest.raises(ValueError, match="NaN"):
            engine.submit(0, 0, float("nan"))
    with pytest.raises(ValueError, match="chunk_bytes"):
        Engine([blobs.path], blobs.size, 1, chunk_bytes=1000)
