"""Free-space checks before long writes (moeinf/disk.py): `moeinf zoo synth` and `moeinf pack` refuse at
once, in one line saying what they need and what is free, and write nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeinf import disk
from moeinf.cli import main
from moeinf.store import StoreError, pack
from moeinf.zoo.synth import SynthError, make_plan, synth

TINY_DSV2 = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3,
             "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
             "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 16, "vocab_size": 8192}


def test_sizes_read_as_people_write_them() -> None:
    assert [disk.size(n) for n in (0, 999, 1000, 23_100_000, 31_400_000_000, 2e12)] == [
        "0 B", "999 B", "1.0 kB", "23.1 MB", "31.4 GB", "2.0 TB"]


def test_free_bytes_of_a_folder_not_made_yet_is_its_disks(tmp_path: Path) -> None:
    assert disk.free_bytes(tmp_path / "a" / "b") == disk.free_bytes(tmp_path) > 0
    assert disk.shortfall(tmp_path / "a", 1, "x") is None
    short = disk.shortfall(tmp_path / "a", disk.free_bytes(tmp_path) + 10**12, "the thing")
    assert short is not None and short.startswith("the thing needs ") and str(tmp_path / "a") in short


def test_synth_refuses_before_writing_and_counts_only_the_shards_left(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    plan = make_plan("deepseek-v2-lite", overrides=TINY_DSV2, shard_bytes=200_000)
    monkeypatch.setattr(disk, "free_bytes", lambda path: plan.total_bytes // 2)
    with pytest.raises(SynthError, match=r"deepseek-v2-lite needs .* are free there; free space"):
        synth("deepseek-v2-lite", tmp_path / "ckpt", overrides=TINY_DSV2, shard_bytes=200_000)
    assert not (tmp_path / "ckpt").exists()
    monkeypatch.undo()
    out = synth("deepseek-v2-lite", tmp_path / "ckpt", overrides=TINY_DSV2, shard_bytes=200_000)
    last = sorted(out.glob("model-*.safetensors"))[-1]
    left = last.stat().st_size
    last.unlink()
    # room for the one missing shard (and the small files) but not for the whole checkpoint: it finishes
    monkeypatch.setattr(disk, "free_bytes", lambda path: left + (8 << 20))
    synth("deepseek-v2-lite", out, overrides=TINY_DSV2, shard_bytes=200_000)
    assert last.stat().st_size == left
    monkeypatch.setattr(disk, "free_bytes", lambda path: left - 1)
    last.unlink()
    with pytest.raises(SynthError, match="the rest of deepseek-v2-lite needs"):
        synth("deepseek-v2-lite", out, overrides=TINY_DSV2, shard_bytes=200_000)


def test_pack_refuses_before_writing(tiny_model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model_dir("qwen2_moe")
    exact = pack(model, tmp_path / "probe", progress=False)
    need = sum(e.size for e in exact.experts)
    monkeypatch.setattr(disk, "free_bytes", lambda path: need - 1)
    with pytest.raises(StoreError, match=r"the store needs .* free there; free space or pack elsewhere"):
        pack(model, tmp_path / "store", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probe"]  # no store, no partial folder
    monkeypatch.setattr(disk, "free_bytes", lambda path: need + (1 << 20))
    pack(model, tmp_path / "store", progress=False)  # room enough: packed


def test_cli_says_it_in_one_line(tiny_model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture) -> None:
    model = tiny_model_dir("olmoe")
    capsys.readouterr()
    monkeypatch.setattr(disk, "free_bytes", lambda path: 1000)
    assert main(["zoo", "synth", "deepseek-v2-lite", str(tmp_path / "ckpt")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "deepseek-v2-lite needs 31.4 GB" in err[0] and "1.0 kB are free" in err[0]
    assert main(["pack", str(model), "--offload-dir", str(tmp_path / "s"),
                 "--no-progress"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the store needs" in err[0]
