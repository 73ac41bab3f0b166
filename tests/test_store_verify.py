"""`verify` and the `moeinf pack` / `moeinf verify` commands: damaged stores are caught, expert named."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from moeinf.cli import main
from moeinf.store import Store, pack, verify
from moeinf.store.fingerprint import fingerprint


@pytest.fixture(scope="module")
def packed(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    store_dir = tmp_path_factory.mktemp("verify") / "store"
    pack(tiny_model_dir("qwen3_moe"), store_dir, progress=False)
    return store_dir


@pytest.fixture
def store_copy(packed: Path, tmp_path: Path) -> Path:
    shutil.copytree(packed, tmp_path / "store")
    return tmp_path / "store"


def test_good_store_has_no_problems(packed: Path) -> None:
    assert verify(packed) == []


def test_flipped_byte_names_the_expert(store_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    entry = Store(store_copy).entry(1, 3)
    with open(store_copy / "experts.bin", "r+b") as f:
        f.seek(entry.offset + 1000)
        byte = f.read(1)
        f.seek(entry.offset + 1000)
        f.write(bytes([byte[0] ^ 0x10]))
    problems = verify(store_copy)
    assert [(p.layer, p.expert, p.file, p.offset) for p in problems] == [(1, 3, "experts.bin", entry.offset)]
    assert "checksum" in problems[0].message
    assert main(["verify", str(store_copy), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert f"expert (1, 3) in experts.bin at offset {entry.offset}" in out


def test_flipped_last_byte_of_a_blob_is_caught(store_copy: Path) -> None:
    entry = Store(store_copy).entry(0, 0)
    with open(store_copy / "experts.bin", "r+b") as f:
        f.seek(entry.offset + entry.size - 1)
        f.write(b"\x01")
    assert [(p.layer, p.expert) for p in verify(store_copy)] == [(0, 0)]


def test_truncated_file_names_the_lost_experts(store_copy: Path) -> None:
    store = Store(store_copy)
    last = store.index.experts[-1]
    os.truncate(store_copy / "experts.bin", last.offset + 100)
    problems = verify(store_copy)
    assert [(p.layer, p.expert) for p in problems] == [(last.layer, last.expert)]
    assert "truncated" in problems[0].message


def test_missing_file_names_every_expert(store_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (store_copy / "experts.bin").unlink()
    problems = verify(store_copy)
    assert len(problems) == 3 * 8
    assert main(["verify", str(store_copy), "--json", "--no-progress"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    named = {(p["layer"], p["expert"]) for p in report["problems"]}
    assert named == {(layer, e) for layer in range(3) for e in range(8)}


def test_missing_dense_file_is_reported(store_copy: Path) -> None:
    (store_copy / "dense.safetensors").unlink()
    problems = verify(store_copy)
    assert [(p.file, p.layer) for p in problems] == [("dense.safetensors", None)]


def test_cli_pack_then_verify(tiny_model_dir, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tiny_model_dir("switch_transformers")
    assert main(["pack", str(src), str(tmp_path / "store"), "--json", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["fingerprint"] == fingerprint(src) == Store(tmp_path / "store").fingerprint
    assert (summary["num_layers"], summary["num_experts"], summary["top_k"]) == (4, 8, 1)
    assert main(["verify", str(tmp_path / "store"), "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    # Packing again is a no-op that still succeeds.
    assert main(["pack", str(src), str(tmp_path / "store"), "--no-progress"]) == 0
    assert "switch_transformers" in capsys.readouterr().out


def test_cli_errors_exit_1(tiny_model_dir, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(tmp_path), "--no-progress"]) == 1
    assert "moeinf pack" in capsys.readouterr().err
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "x").write_text("x")
    assert main(["pack", str(tiny_model_dir("olmoe")), str(tmp_path / "store"), "--no-progress"]) == 1
    assert "refusing to overwrite" in capsys.readouterr().err


def test_inconsistent_index_is_reported(store_copy: Path) -> None:
    from moeinf.store.index import INDEX_NAME

    data = json.loads((store_copy / INDEX_NAME).read_text())
    del data["index_checksum"]  # edited by hand, as an index written before index checksums
    data["experts"][5]["offset"] += 8
    data["experts"][9]["tensors"]["down_proj"]["offset"] = data["experts"][9]["size"]
    (store_copy / INDEX_NAME).write_text(json.dumps(data))
    named = {(p.layer, p.expert) for p in verify(store_copy) if "corrupt index" in p.message}
    assert named == {(0, 5), (0, 6), (1, 1)}


def test_verify_takes_the_model_a_store_was_packed_from(tiny_model_dir, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "model"
    shutil.copytree(tiny_model_dir("olmoe"), src)
    capsys.readouterr()  # what building the tiny model printed
    assert main(["verify", str(src), "--no-progress"]) == 1  # not packed yet: says so, names the command
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no packed store yet" in err[0] and f"moeinf pack {src}" in err[0]
    assert main(["pack", str(src), "--no-progress"]) == 0  # into model.moeinf, where every command looks
    capsys.readouterr()
    assert main(["verify", str(src), "--json", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["store_dir"] == str(tmp_path / "model.moeinf")
    assert "the store of" in captured.err
    with open(tmp_path / "model.moeinf" / "experts.bin", "r+b") as f:  # a damaged store: the model names it
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert main(["verify", str(src), "--no-progress"]) == 1
