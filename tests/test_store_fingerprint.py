"""The model fingerprint: deterministic, shared by a checkpoint and its store, sensitive to config,
tensor layout and router weights, blind to re-saving noise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeinf.hf.tiny import save_tiny
from moeinf.store import pack
from moeinf.store.fingerprint import fingerprint


def copy_with(src: Path, dst: Path, key: str, change) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors[key] = change(tensors[key])
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_deterministic_and_shared_with_the_store(tiny_model_dir, tmp_path: Path) -> None:
    src = tiny_model_dir("mixtral")
    value = fingerprint(src)
    assert len(value) == 64 and value == fingerprint(src)
    pack(src, tmp_path / "store", progress=False)
    assert fingerprint(tmp_path / "store") == value


def test_another_training_differs(tiny_model_dir, tmp_path: Path) -> None:
    assert fingerprint(save_tiny("mixtral", tmp_path / "b", seed=1)) != fingerprint(tiny_model_dir("mixtral"))


@pytest.mark.parametrize(("family", "router"), [
    ("mixtral", "model.layers.1.block_sparse_moe.gate.weight"),
    ("gpt_oss", "model.layers.0.mlp.router.bias"),
    ("switch_transformers", "decoder.block.1.layer.2.mlp.router.classifier.weight"),
])
def test_router_bytes_count(family: str, router: str, tiny_model_dir, tmp_path: Path) -> None:
    src = tiny_model_dir(family)
    changed = copy_with(src, tmp_path / "changed", router, lambda t: t + 1e-3)
    assert fingerprint(changed) != fingerprint(src)


def test_tensor_dtype_counts(tiny_model_dir, tmp_path: Path) -> None:
    src = tiny_model_dir("olmoe")
    key = "model.layers.0.self_attn.q_proj.weight"
    changed = copy_with(src, tmp_path / "changed", key, lambda t: t.to(torch.bfloat16))
    assert fingerprint(changed) != fingerprint(src)


def test_resaving_noise_and_config_changes(tiny_model_dir, tmp_path: Path) -> None:
    src = tiny_model_dir("olmoe")
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(
        {**config, "transformers_version": "0.0.1", "_name_or_path": "elsewhere"}, indent=4))
    assert fingerprint(copy) == fingerprint(src)
    (copy / "config.json").write_text(json.dumps({**config, "rope_theta": 1.0}))
    assert fingerprint(copy) != fingerprint(src)


def test_a_checkpoint_without_moe_layers_is_refused_with_the_config_field(tmp_path: Path) -> None:
    """A user's DeepSeek-V3 config of 3 layers keeps first_k_dense_replace=3: every layer dense."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moeinf.spec import UnsupportedModelError

    config = AutoConfig.for_model(
        "deepseek_v3", hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, vocab_size=64, n_routed_experts=4, kv_lora_rank=8,
        q_lora_rank=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "dense")
    with pytest.raises(UnsupportedModelError, match=r"no MoE layer.*first_k_dense_replace=3 >= num_hidden_"):
        fingerprint(tmp_path / "dense")
