"""`moeinf zoo synth` on scaled-down configurations (the full-size path is the same code with bigger shapes):
HF loads every tensor it writes, moeinf packs it and generates HF's greedy tokens, an interrupted synth
finishes to the same bytes, and another plan in the same directory is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeinf.cli import main
from moeinf.zoo.synth import ARCHITECTURES, SynthError, make_plan, synth

# Tiny sizes, same structure: dense first layer, shared experts, MLA without q LoRA.
TINY: dict[str, dict] = {
    "deepseek-v2-lite": {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
                         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
                         "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                         "v_head_dim": 16, "n_routed_experts": 16, "vocab_size": 8192},
    "qwen3-30b-a3b": {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
                      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                      "head_dim": 16, "num_experts": 16, "vocab_size": 8192},
    "mixtral-8x7b": {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 8192},
    "olmoe-1b-7b": {"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 16,
                    "vocab_size": 8192},
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: on a busy 2-core machine a second OpenMP thread spins (tiny products 100x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_full_size_plan_matches_the_published_model() -> None:
    plan = make_plan("deepseek-v2-lite")
    params = plan.total_bytes // 2
    assert 15.6e9 < params < 15.8e9  # DeepSeek-V2-Lite: 15.7 B parameters
    names = [t.name for ts in plan.shards.values() for t in ts]
    down = "model.layers.1.mlp.experts.63.down_proj.weight"
    expert = [t for ts in plan.shards.values() for t in ts if t.name == down]
    assert expert and expert[0].shape == (2048, 1408)
    assert not any(n.startswith("model.layers.0.mlp.experts") for n in names)  # layer 0 is dense
    assert sum(n.endswith("gate_proj.weight") and ".experts." in n for n in names) == 26 * 64
    assert all(plan.shard_bytes(f) <= 2 * 2**30 + 2**20 for f in plan.shards)


@pytest.mark.parametrize("name", sorted(TINY))
def test_hf_loads_every_tensor_synth_writes(name: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = synth(name, tmp_path / name, overrides=TINY[name], shard_bytes=100_000)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == ARCHITECTURES[name].config["model_type"]
    weights = [p for n, p in model.named_parameters() if n.endswith("proj.weight")]
    assert 0.015 < float(weights[0].detach().float().std()) < 0.025
    assert len(list(out.glob("*.safetensors"))) > 1


def test_moeinf_generates_hf_greedy_tokens_on_a_synthesised_model(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from moeinf import MoE, OffloadConfig

    out = synth("deepseek-v2-lite", tmp_path / "dsv2", overrides=TINY["deepseek-v2-lite"],
                shard_bytes=200_000)
    ids = torch.randint(3, 8192, (1, 12), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.inference_mode():
        expected = hf.generate(ids, max_new_tokens=10, do_sample=False)
    with MoE(out, OffloadConfig(device_cache=0.3, offload_dir=str(tmp_path / "store"))) as moe:
        got = moe.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, expected)


def test_interrupted_synth_finishes_to_the_same_bytes(tmp_path: Path) -> None:
    tiny = TINY["deepseek-v2-lite"]
    whole = synth("deepseek-v2-lite", tmp_path / "whole", overrides=tiny, shard_bytes=200_000)
    part = synth("deepseek-v2-lite", tmp_path / "part", overrides=tiny, shard_bytes=200_000)
    shards = sorted(part.glob("model-*.safetensors"))
    shards[1].unlink()  # a shard never renamed into place
    shards[2].write_bytes(shards[2].read_bytes()[:1000])  # a truncated one
    (part / f".{shards[3].name}.partial").write_bytes(b"x")  # a temporary file left by a kill
    lines: list[str] = []
    synth("deepseek-v2-lite", part, overrides=tiny, shard_bytes=200_000, progress=lines.append)
    assert any("already complete" in line for line in lines)
    for shard in sorted(whole.glob("*.safetensors")):
        assert (part / shard.name).read_bytes() == shard.read_bytes()
    assert not list(part.glob(".*.partial"))
    with pytest.raises(SynthError, match="another plan"):
        synth("deepseek-v2-lite", part, overrides=tiny, shard_bytes=200_000, seed=1)


def test_cli_refuses_a_non_empty_directory_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "other.txt").write_text("x")
    assert main(["zoo", "synth", "deepseek-v2-lite", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not empty" in err[0]
