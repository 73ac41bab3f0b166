"""Every script in examples/ runs as a user would run it (on tiny models, given as its argument)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(script: str, *args: str, cwd: Path) -> str:
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, capture_output=True,
                            text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> Path:
    return tiny_model_dir("qwen3_moe")


def test_every_example_is_tested() -> None:
    tested = {"wrap_hf_model.py", "trace_eamc.py", "replay_trace.py", "serve_openai.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_wrap_hf_model(model: Path, tmp_path: Path) -> None:
    out = run("wrap_hf_model.py", str(model), "--store", str(tmp_path / "store"), cwd=tmp_path)
    assert "expert accesses" in out and "hit rate" in out and "prefetches" in out


def test_trace_eamc(model: Path, tmp_path: Path) -> None:
    from moeinf.trace import EAMC

    out = run("trace_eamc.py", str(model), "--limit", "2", "--out", str(tmp_path / "x.eamc"), cwd=tmp_path)
    assert "with the EAMC: prefetches" in out
    assert EAMC.load(tmp_path / "x.eamc").num_experts > 0


def test_replay_trace(model: Path, tmp_path: Path) -> None:
    run("replay_trace.py", str(model), "--duration", "5", "--out", str(tmp_path / "replay"), cwd=tmp_path)
    summary = json.loads((tmp_path / "replay" / "summary.json").read_text())
    assert summary


def test_serve_openai(model: Path, tmp_path: Path) -> None:
    out = run("serve_openai.py", str(model), cwd=tmp_path)
    assert "hit" in out and "moeinf_runtime_tokens" in out
    assert "serving" not in out and "INFO" not in out  # the server's log goes to its file
    assert list(tmp_path.iterdir()) == []


def test_examples_write_only_under_a_temporary_or_given_directory(model: Path, tmp_path: Path) -> None:
    """Run with no output flag from a clean directory, the examples leave nothing in it (they wrote
    example.eamc and replay-out/ into the working directory); the server's log is kept out of stdout."""
    run("trace_eamc.py", str(model), "--limit", "1", cwd=tmp_path)
    run("replay_trace.py", str(model), "--duration", "2", "--length-scale", "0.02", cwd=tmp_path)
    assert list(tmp_path.iterdir()) == []
