"""The engine under concurrent churn: 4 I/O threads, thousands of verified reads of small chunks, random
re-prioritisations, cancels and releases from 4 client threads. A chunk whose checksum is merged after
its read is settled would fail a good blob ("checksum mismatch") or read into a freed slot (the process
aborts); neither may happen, and every slot comes back."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import numpy as np
from waiting import until

from moeinf.engine import ALIGNMENT, Engine, EngineError, checksum

KEYS, BLOB, CLIENTS, ROUNDS = 64, 64 * ALIGNMENT, 4, 120


def test_churn_with_four_io_threads_never_fails_a_good_blob_nor_leaks_a_slot(tmp_path: Path) -> None:
    path = tmp_path / "experts.bin"
    data = np.random.default_rng(0).integers(0, 256, size=KEYS * BLOB, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    problems: list[str] = []
    options = {"io_threads": 4, "chunk_bytes": ALIGNMENT, "direct_io": False, "verify": True}
    with Engine([path], BLOB, 24, **options) as engine:
        for e in range(KEYS):
            engine.add(0, e, 0, e * BLOB, BLOB, checksum(data[e * BLOB : (e + 1) * BLOB]))

        def client(seed: int) -> None:
            rng = random.Random(seed)
            own = range(seed * KEYS // CLIENTS, (seed + 1) * KEYS // CLIENTS)  # a waiter owns its keys
            for _ in range(ROUNDS):
                keys = rng.sample(own, 6)
                for e in keys:
                    engine.submit(0, e, rng.random())
                for e in keys:
                    if rng.random() < 0.3:
                        engine.submit(0, e, rng.random())  # re-prioritise, maybe mid-read
                    if rng.random() < 0.3:
                        engine.cancel(0, e)
                for e in keys:
                    try:
                        if rng.random() < 0.5:
                            view = np.frombuffer(engine.wait(0, e, timeout=30), np.uint8)
                            if not np.array_equal(view, data[e * BLOB : (e + 1) * BLOB]):
                                problems.append(f"expert {e}: wrong bytes")
                    except (EngineError, TimeoutError) as exc:
                        problems.append(str(exc))
                    engine.release(0, e)  # resident, queued or mid-read: all must give the slot back

        threads = [threading.Thread(target=client, args=(seed,)) for seed in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = engine.stats()
        assert problems == []
        assert stats["failures"] == 0
        assert stats["fetches_demand"] + stats["fetches_prefetch"] >= 1500, stats  # ~2,900 submits
        assert engine.resident() == [] and engine.queued() == []
        # A read released mid-chunk gives its slot back when that chunk lands.
        until(lambda: engine.free_slots() == 24, "every slot to come back")
        assert all(engine.state(0, e) == "idle" for e in range(KEYS))
