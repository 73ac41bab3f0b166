"""The benchmarks around quantised stores: the per-token time breakdown and `bench llamacpp`'s refusals."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

from moeinf import OffloadConfig
from moeinf.bench import llamacpp
from moeinf.bench.decode_profile import CPU_PARTS, PARTS, profile_decode


def test_decode_profile_splits_every_decoded_token(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("qwen3_moe")
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache=0.3)
    inputs = [torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    result = profile_decode(model_dir, config, inputs[:1], inputs[1:], new_tokens=5)
    # the gaps between consecutive decode steps of the two measured prompts
    assert result["steps"] == 2 * 4
    parts = result["parts_ms"]
    assert set(parts) == set(PARTS)
    assert parts["expert_compute"] > 0 and parts["dense_and_framework"] > 0 and parts["reads"] >= 0
    assert sum(parts.values()) == pytest.approx(result["mean_ms"], rel=1e-6)
    # the CPU-time split of the decoding thread: no part negative, none above its wall time
    cpu = result["cpu_parts_ms"]
    assert set(cpu) == set(CPU_PARTS)
    assert all(cpu[part] >= 0 for part in CPU_PARTS) and cpu["expert_compute"] > 0
    assert result["median_cpu_ms"] > 0
    assert cpu["expert_compute"] <= parts["expert_compute"] * 1.05 + 0.05
    assert result["stats"]["misses"] > 0  # a 30% cache really offloaded


def test_bench_llamacpp_without_llama_cpp_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    parser = argparse.ArgumentParser()
    llamacpp.add_arguments(parser)
    assert llamacpp.run(parser.parse_args(["full"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'moeinf[llamacpp]'" in err[0]


def test_equal_dram_needs_a_working_memory_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoLock:
        def mlock(self, *args: object) -> int:
            return -1

    monkeypatch.setattr(llamacpp.ctypes, "CDLL", lambda *a, **k: NoLock())
    with pytest.raises(llamacpp.Refusal, match="mlock of 64 MiB is not permitted"):
        llamacpp.check_mlock()


def test_llama_cpp_conversion_of_deepseek_without_q_lora(tmp_path: Path) -> None:
    """llama.cpp loads a DeepSeek GGUF without q-LoRA only with q_lora_rank written (as 0), and routes
    DeepSeek-V3 by sigmoid only when the gating function is written."""
    import os
    import subprocess

    root = os.environ.get("LLAMA_CPP_DIR")
    if not root or not (Path(root) / "convert_hf_to_gguf.py").is_file():
        pytest.skip("needs a llama.cpp source tree in $LLAMA_CPP_DIR (the llama-cpp-python sdist's "
                    "vendor/llama.cpp)")
    from moeinf.zoo import get_model

    model_dir = get_model("full")  # DeepSeek-V3 with q_lora_rank null, and a tokenizer to convert
    out = tmp_path / "model-BF16.gguf"
    done = subprocess.run([sys.executable, "-c", llamacpp.CONVERT, root, str(model_dir), "--outtype", "bf16",
                           "--outfile", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-400:]
    sys.path.insert(0, str(Path(root) / "gguf-py"))
    try:
        import gguf
    finally:
        sys.path.pop(0)
    fields = gguf.GGUFReader(out).fields

    def value(key: str) -> int:
        field = fields[key]
        return int(field.parts[field.data[0]][0])

    assert value("deepseek2.attention.q_lora_rank") == 0
    assert value("deepseek2.expert_gating_func") == int(gguf.ExpertGatingFuncType.SIGMOID)
