"""Pack round trips: every expert and dense tensor read back from a store equals the weights of the
unmodified HF model loaded with `from_pretrained` from the same checkpoint."""

from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from moeinf.hf.tiny import FAMILIES, save_tiny
from moeinf.spec import spec_for
from moeinf.store import Store, StoreError, pack
from moeinf.store.fingerprint import fingerprint
from moeinf.store.index import ALIGNMENT, INDEX_NAME


def load_hf(model_dir: Path) -> torch.nn.Module:
    config = json.loads((model_dir / "config.json").read_text())
    spec = spec_for(config["model_type"])
    auto = AutoModelForSeq2SeqLM if spec.task == "seq2seq-lm" else AutoModelForCausalLM
    return auto.from_pretrained(model_dir).eval()


def runtime_expert_tensor(model: torch.nn.Module, module_name: str, expert: int, name: str) -> torch.Tensor:
    """Expert `expert`'s tensor `name` as the loaded runtime model holds it."""
    module = model.get_submodule(module_name)
    if isinstance(getattr(module, name, None), torch.nn.Parameter):
        return getattr(module, name)[expert]  # fused [E, ...]
    return module.get_submodule(f"expert_{expert}").get_parameter(name)  # Switch: one module per expert


def assert_store_matches_model(store: Store, model: torch.nn.Module) -> None:
    index = store.index
    assert [n for n, _ in model.named_modules() if n in set(index.modules)] == index.modules
    for entry in index.experts:
        got = store.read_expert(entry.layer, entry.expert)
        assert got.keys() == entry.tensors.keys()
        for name, tensor in got.items():
            expected = runtime_expert_tensor(model, index.modules[entry.layer], entry.expert, name)
            assert tensor.dtype == expected.dtype
            torch.testing.assert_close(tensor, expected, rtol=0, atol=0,
                                       msg=f"{name} of expert ({entry.layer}, {entry.expert})")
    dense = store.load_dense()
    state = model.state_dict()
    for key, tensor in dense.items():
        torch.testing.assert_close(tensor, state[key], rtol=0, atol=0, msg=key)
    # Every runtime weight outside the experts is in dense.safetensors under one of its tied names.
    aliases: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), set()).add(name)
    prefixes = tuple(m + "." for m in index.modules)
    for names in aliases.values():
        if not next(iter(names)).startswith(prefixes):
            assert names & dense.keys(), names


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_round_trip_equals_from_pretrained(family: str, tiny_model_dir, tmp_path: Path) -> None:
    src = tiny_model_dir(family)
    index = pack(src, tmp_path / "store", progress=False)
    store = Store(tmp_path / "store")
    assert store.index == index
    model = load_hf(src)
    assert index.model_type == model.config.model_type
    assert index.num_layers == len(index.modules) > 0
    assert index.top_k == spec_for(family).top_k(model.config)
    for entry in index.experts:
        assert entry.offset % ALIGNMENT == 0 and entry.size % ALIGNMENT == 0
        assert entry.nbytes <= entry.size
        assert all(t.offset % 64 == 0 for t in entry.tensors.values())
    assert os.path.getsize(store.path(0)) == store.expert_bytes
    assert_store_matches_model(store, model)
    assert (tmp_path / "store" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert (tmp_path / "store" / "generation_config.json").is_file()
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(tmp_path / "store").st_mode & 0o777 == 0o777 & ~umask


def test_mixtral_dense_keys_are_runtime_keys(tiny_model_dir, tmp_path: Path) -> None:
    pack(tiny_model_dir("mixtral"), tmp_path / "store", progress=False)
    keys = Store(tmp_path / "store").load_dense().keys()
    assert "model.layers.0.mlp.gate.weight" in keys
    assert not [k for k in keys if "block_sparse_moe" in k]


def test_bfloat16_round_trip(tmp_path: Path) -> None:
    src = save_tiny("qwen3_moe", tmp_path / "src", dtype="bfloat16")
    index = pack(src, tmp_path / "store", progress=False)
    assert index.dtype == "bfloat16"
    model = load_hf(src)
    assert model.dtype == torch.bfloat16
    assert_store_matches_model(Store(tmp_path / "store"), model)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "switch_transformers"])
def test_sharded_checkpoint(family: str, tiny_model_dir, tmp_path: Path) -> None:
    model = load_hf(tiny_model_dir(family))
    model.save_pretrained(tmp_path / "src", max_shard_size="100KB")
    assert (tmp_path / "src" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "src").glob("*.safetensors"))) > 2
    pack(tmp_path / "src", tmp_path / "store", progress=False)
    assert_store_matches_model(Store(tmp_path / "store"), model)
    # Sharding changes nothing the fingerprint covers.
    assert fingerprint(tmp_path / "src") == fingerprint(tiny_model_dir(family))


def test_repack_same_model_is_a_no_op(tiny_model_dir, tmp_path: Path) -> None:
    src = tiny_model_dir("olmoe")
    first = pack(src, tmp_path / "store", progress=False)
    before = os.stat(tmp_path / "store" / "experts.bin").st_mtime_ns
    assert pack(src, tmp_path / "store", progress=False) == first
    assert os.stat(tmp_path / "store" / "experts.bin").st_mtime_ns == before


def test_refuses_to_overwrite_another_model(tiny_model_dir, tmp_path: Path) -> None:
    pack(tiny_model_dir("olmoe"), tmp_path / "store", progress=False)
    other = save_tiny("olmoe", tmp_path / "other", seed=1)
    with pytest.raises(StoreError, match="another model") as excinfo:
        pack(other, tmp_path / "store", progress=False)
    assert str(tmp_path / "store") in str(excinfo.value) and str(other) in str(excinfo.value)
    assert Store(tmp_path / "store").fingerprint == fingerprint(tiny_model_dir("olmoe"))


def test_refuses_a_non_empty_directory(tiny_model_dir, tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="not empty"):
        pack(tiny_model_dir("olmoe"), tmp_path / "store", progress=False)
    assert (tmp_path / "store" / "notes.txt").read_text() == "mine"


def test_packs_into_an_empty_directory(tiny_model_dir, tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    pack(tiny_model_dir("olmoe"), tmp_path / "store", progress=False)
    assert (tmp_path / "store" / INDEX_NAME).is_file()


def test_failing_pack_leaves_nothing(tiny_model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The package re-exports the function `pack`, which hides the module of the same name.
    pack_module = importlib.import_module("moeinf.store.pack")

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(pack_module, "write_streaming", fail)
    with pytest.raises(OSError, match="disk full"):
        pack(tiny_model_dir("qwen2_moe"), tmp_path / "store", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_missing_expert_is_named(tiny_model_dir, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(tiny_model_dir("qwen3_moe"), src)
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight"):
        pack(src, tmp_path / "store", progress=False)
    assert not (tmp_path / "store").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]


def test_inconsistent_expert_dtype_is_refused(tiny_model_dir, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(tiny_model_dir("qwen3_moe"), src)
    tensors = load_file(src / "model.safetensors")
    for name in ("gate_proj", "up_proj", "down_proj"):
        key = f"model.layers.2.mlp.experts.3.{name}.weight"
        tensors[key] = tensors[key].to(torch.float16)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="expert 3 of model.layers.2.mlp.experts"):
        pack(src, tmp_path / "store", progress=False)


def test_tensors_views_a_buffer_without_copying(tiny_model_dir, tmp_path: Path) -> None:
    pack(tiny_model_dir("gpt_oss"), tmp_path / "store", progress=False)
    store = Store(tmp_path / "store")
    blob = store.read_blob(2, 7)
    views = store.tensors(2, 7, blob)
    views["down_proj_bias"][0] = 123.0
    assert store.tensors(2, 7, blob)["down_proj_bias"][0].item() == 123.0
    with pytest.raises(ValueError, match="writable"):
        store.tensors(2, 7, bytes(blob))
    assert store.max_blob_size == store.entry(2, 7).size
    with pytest.raises(KeyError, match="3 MoE layers of 8 experts"):
        store.entry(3, 0)


def test_store_errors_name_the_directory(tiny_model_dir, tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="moeinf pack") as excinfo:
        Store(tmp_path)
    assert str(tmp_path) in str(excinfo.value)
    pack(tiny_model_dir("olmoe"), tmp_path / "store", progress=False)
    index_path = tmp_path / "store" / INDEX_NAME
    data = json.loads(index_path.read_text())
    del data["index_checksum"]  # an index edited by hand, as one written before index checksums
    index_path.write_text(json.dumps({**data, "version": 99}))
    with pytest.raises(StoreError, match=r"version 99.*moeinf pack"):
        Store(tmp_path / "store")
    index_path.write_text("{not json")
    with pytest.raises(StoreError, match=r"unreadable.*moeinf pack"):
        Store(tmp_path / "store")
    index_path.write_text(json.dumps({**data, "experts": data["experts"][:-1]}))
    with pytest.raises(StoreError, match="lists 23 experts"):
        Store(tmp_path / "store")


def test_pack_removes_what_a_killed_pack_left(tiny_model_dir, tmp_path: Path) -> None:
    dead = tmp_path / ".store.partial-999999999-x"  # beyond pid_max: no such process
    dead.mkdir()
    (dead / "experts.bin").write_bytes(b"half")
    alive = tmp_path / f".store.partial-{os.getpid()}-y"
    alive.mkdir()
    pack(tiny_model_dir("olmoe"), tmp_path / "store", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, "store"])


def test_tokenizer_files_are_copied(tiny_model_dir, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny_model_dir("olmoe"), src)
    (src / "tokenizer.json").write_text('{"version": "1.0"}')
    (src / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (src / "notes.md").write_text("not copied")
    pack(src, tmp_path / "store", progress=False)
    names = {p.name for p in (tmp_path / "store").iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"} <= names
    assert "notes.md" not in names
    assert (tmp_path / "store" / "tokenizer.json").read_text() == '{"version": "1.0"}'


def test_quantized_checkpoint_is_refused(tiny_model_dir, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny_model_dir("gpt_oss"), src)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized checkpoint .mxfp4."):
        pack(src, tmp_path / "store", progress=False)
