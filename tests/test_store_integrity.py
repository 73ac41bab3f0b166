"""Every byte of a store is checked: a flipped byte in any file kind is caught by `verify`, corrupted dense
weights are refused when loaded, old stores without dense checksums still load (and are named unchecked),
and `pack` repairs a damaged or half-made store or refuses with what to do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from moeinf.cli import main
from moeinf.store import Store, StoreError, pack, unchecked, verify
from moeinf.store.checksum import checksum, file_checksum
from moeinf.store.index import DENSE_FILE, EXPERTS_FILE, INDEX_NAME

FILE_KINDS = [EXPERTS_FILE, DENSE_FILE, INDEX_NAME, "config.json"]


@pytest.fixture(scope="module")
def src(tiny_model_dir) -> Path:
    return tiny_model_dir("qwen3_moe")


@pytest.fixture(scope="module")
def packed(src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    store_dir = tmp_path_factory.mktemp("integrity") / "store"
    pack(src, store_dir, progress=False)
    return store_dir


@pytest.fixture
def store_copy(packed: Path, tmp_path: Path) -> Path:
    shutil.copytree(packed, tmp_path / "store")
    return tmp_path / "store"


def flip(path: Path, where: float) -> None:
    """Flip the low bit of the byte at fraction `where` of the file (0: first byte, 1: last byte)."""
    data = bytearray(path.read_bytes())
    at = min(int(where * len(data)), len(data) - 1)
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_file_checksum_is_the_blob_checksum_of_the_zero_padded_file(tmp_path: Path, monkeypatch) -> None:
    import moeinf.store.checksum as module

    monkeypatch.setattr(module, "_FILE_BLOCK", 64)  # several blocks, the last one short
    for n in (1, 8, 63, 64, 65, 200):
        data = bytes(range(n % 256)) * (n // 256) + bytes((i * 7) % 256 for i in range(n % 256))
        (tmp_path / "f").write_bytes(data)
        assert file_checksum(tmp_path / "f") == checksum(data + bytes(-len(data) % 8)), n


def test_stream_checksum_of_pieces_is_the_file_checksum(tmp_path: Path) -> None:
    from moeinf.store.checksum import StreamChecksum

    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 8, 9, 63, 200, 1001):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        stream, at = StreamChecksum(), 0
        while at < n:  # pieces of 1-20 bytes: words straddle pieces
            step = int(rng.integers(1, 21))
            stream.update(data[at : at + step])
            at += step
        (tmp_path / "f").write_bytes(data)
        assert stream.digest() == file_checksum(tmp_path / "f") == checksum(data + bytes(-n % 8)), n


def test_pack_checksums_the_dense_file_as_it_writes_it(tiny_model_dir, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # Reading the dense file back re-reads gigabytes from the drive when the page cache cannot hold them.
    import importlib

    pack_module = importlib.import_module("moeinf.store.pack")
    read_back: list[str] = []
    real = pack_module.file_checksum

    def recording(path: Path) -> int:
        read_back.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(pack_module, "file_checksum", recording)
    pack_module.pack(tiny_model_dir("olmoe"), tmp_path / "store", progress=False)
    assert DENSE_FILE not in read_back
    assert not verify(tmp_path / "store")


def test_the_index_has_a_checksum_for_every_file(packed: Path) -> None:
    data = json.loads((packed / INDEX_NAME).read_text())
    files = {p.name for p in packed.iterdir()} - {INDEX_NAME, EXPERTS_FILE}
    assert set(data["file_checksums"]) == files and DENSE_FILE in files
    assert isinstance(data["index_checksum"], int)
    assert not verify(packed) and unchecked(packed) == []


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0], ids=["first", "middle", "last"])
@pytest.mark.parametrize("name", FILE_KINDS)
def test_verify_catches_a_flipped_byte_in_every_file(store_copy: Path, name: str, where: float,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    flip(store_copy / name, where)
    assert main(["verify", str(store_copy), "--no-progress"]) == 1
    out = capsys.readouterr()
    assert "all experts" not in out.out
    if name == INDEX_NAME:
        (line,) = [line for line in out.err.splitlines() if "error:" in line]
        assert "moeinf pack" in line
    else:
        assert name in out.out


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0], ids=["first", "middle", "last"])
def test_corrupted_dense_weights_are_refused_when_loaded(store_copy: Path, where: float) -> None:
    flip(store_copy / DENSE_FILE, where)
    with pytest.raises((StoreError, Exception)) as excinfo:
        Store(store_copy).load_dense()
    if where != 0.0:  # a flip in the header's first byte may fail the check or the parse first
        assert excinfo.type is StoreError
        assert "checksum mismatch" in str(excinfo.value) and "moeinf pack" in str(excinfo.value)


def test_generate_refuses_corrupted_dense_weights_in_one_line(src: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    store_dir = tmp_path / "store"
    pack(src, store_dir, progress=False)
    flip(store_dir / DENSE_FILE, 0.6)
    code = main(["generate", str(src), "--offload-dir", str(store_dir), "--prompt", "hello",
                 "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert "Traceback" not in "\n".join(err)
    assert any("checksum mismatch" in line and DENSE_FILE in line for line in err)


def _as_old_store(store_dir: Path) -> None:
    """Rewrite the index as moeinf wrote it before whole-file and index checksums."""
    data = json.loads((store_dir / INDEX_NAME).read_text())
    del data["file_checksums"], data["index_checksum"]
    (store_dir / INDEX_NAME).write_text(json.dumps(data, indent=1) + "\n")


def test_an_old_store_loads_and_verify_names_the_unchecked_dense_file(
    store_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _as_old_store(store_copy)
    assert Store(store_copy).load_dense()
    assert unchecked(store_copy) == [DENSE_FILE]
    assert main(["verify", str(store_copy), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "UNCHECKED dense.safetensors" in out and "moeinf pack" in out
    assert "the experts are good" in out


def test_pack_repairs_a_store_with_a_flipped_byte(src: Path, store_copy: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    flip(store_copy / DENSE_FILE, 0.7)
    flip(store_copy / EXPERTS_FILE, 0.3)
    assert verify(store_copy)
    assert main(["pack", str(src), str(store_copy), "--no-progress"]) == 0
    assert verify(store_copy) == []
    assert sorted(p.name for p in store_copy.parent.iterdir()) == ["store"]  # nothing left aside


def test_pack_repairs_a_store_cut_short_even_without_verifying(src: Path, store_copy: Path) -> None:
    with open(store_copy / EXPERTS_FILE, "r+b") as f:
        f.truncate(4096)
    pack(src, store_copy, progress=False)
    assert verify(store_copy) == []


def test_pack_refuses_a_store_whose_index_is_damaged_with_what_to_do(
    src: Path, store_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flip(store_copy / INDEX_NAME, 0.5)
    assert main(["pack", str(src), str(store_copy), "--no-progress"]) == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert "damaged store" in line and "Move it away" in line and "moeinf pack" in line


def test_a_half_made_store_is_replaced_by_the_next_pack(src: Path, store_copy: Path) -> None:
    (store_copy / INDEX_NAME).unlink()  # killed before the index was written
    with open(store_copy / DENSE_FILE, "r+b") as f:
        f.truncate(100)
    pack(src, store_copy, progress=False)
    assert verify(store_copy) == []


def test_a_directory_with_other_files_is_still_refused(src: Path, store_copy: Path) -> None:
    (store_copy / INDEX_NAME).unlink()
    (store_copy / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="refusing to overwrite"):
        pack(src, store_copy, progress=False)
    assert (store_copy / "notes.txt").read_text() == "mine"
