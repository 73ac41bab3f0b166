"""A store read through the I/O engine: the blobs the engine delivers (checksummed in C++) viewed with
`Store.tensors` equal the weights of the unmodified HF model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_store import load_hf, runtime_expert_tensor

from moeinf.store import Store, pack

engine = pytest.importorskip("moeinf.engine", reason="moeinf.engine (the C++ I/O engine) is not built")


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "switch_transformers"])
def test_engine_reads_equal_from_pretrained(family: str, tiny_model_dir, tmp_path: Path) -> None:
    src = tiny_model_dir(family)
    pack(src, tmp_path / "store", progress=False)
    store = Store(tmp_path / "store")
    model = load_hf(src)
    with engine.Engine.from_store(store, num_slots=3) as io:
        for entry in store.index.experts:
            blob = io.wait(entry.layer, entry.expert, timeout=30)
            assert engine.checksum(blob[: entry.size]) == entry.checksum
            for name, tensor in store.tensors(entry.layer, entry.expert, blob).items():
                expected = runtime_expert_tensor(model, store.index.modules[entry.layer], entry.expert, name)
                torch.testing.assert_close(tensor, expected, rtol=0, atol=0)
            io.release(entry.layer, entry.expert)


def test_engine_rejects_a_corrupted_blob(tiny_model_dir, tmp_path: Path) -> None:
    pack(tiny_model_dir("qwen3_moe"), tmp_path / "packed", progress=False)
    shutil.copytree(tmp_path / "packed", tmp_path / "store")
    store = Store(tmp_path / "store")
    entry = store.entry(2, 6)
    with open(store.path(0), "r+b") as f:
        f.seek(entry.offset + 8)
        f.write(b"\xff" * 8)
    with engine.Engine.from_store(store, num_slots=2) as io:
        with pytest.raises(engine.EngineError, match=r"layer 2, expert 6\): checksum mismatch"):
            io.wait(2, 6, timeout=30)
        assert io.wait(2, 5, timeout=30) is not None
