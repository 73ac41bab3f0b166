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
