"""bench/make_store.py --raw writes a store the runtime's index and checksums accept (what `moeinf bench io`
reads)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

from moeinf.store.checksum import checksum
from moeinf.store.index import StoreIndex

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "make_store.py"


def test_raw_store_is_readable_and_checksummed(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_make_store", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    out = tmp_path / "store"
    assert module.main(["--raw", "--out", str(out), "--layers", "1", "--experts", "2"]) == 0
    assert module.main(["--raw", "--out", str(out)]) == 1  # never writes over a store

    index = StoreIndex.load(out)
    assert (index.num_layers, index.num_experts) == (1, 2)
    blobs = (out / "experts.bin").read_bytes()
    gate_up, down = 2 * module.EXPERT_INTERMEDIATE * module.HIDDEN, module.HIDDEN * module.EXPERT_INTERMEDIATE
    expert_bytes = 2 * (gate_up + down)  # bf16
    for entry in index.experts:
        blob = np.frombuffer(blobs, dtype=np.uint8, count=entry.size, offset=entry.offset)
        assert entry.nbytes == expert_bytes and entry.offset % 4096 == 0
        assert checksum(blob) == entry.checksum
