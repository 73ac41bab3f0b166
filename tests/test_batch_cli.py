"""`moeinf batch` end to end on a tiny model: answers, one-line errors, --plan, and a SIGKILL halfway
followed by a rerun that answers every prompt exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moeinf.cli import main

PROMPTS = 12


@pytest.fixture
def job(tiny_model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.setenv("MOEINF_CACHE", str(tmp_path / "cache"))  # the roofline's rates and kernel table
    model = tiny_model_dir("qwen3_moe")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": "tell me " * (1 + i % 5)}) + "\n"
                               for i in range(PROMPTS)))
    argv = ["batch", str(model), "--prompts", str(prompts), "--out", str(tmp_path / "answers.jsonl"),
            "--device-cache", "50%", "--offload-dir", str(tmp_path / "store"), "--max-new-tokens", "6",
            "--progress-every", "0"]
    return {"argv": argv, "out": tmp_path / "answers.jsonl", "prompts": prompts, "tmp": tmp_path}


def answered(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_prompt_is_answered_once_with_progress(job: dict, capsys) -> None:
    assert main([*job["argv"], "--batch-size", "5"]) == 0
    rows = answered(job["out"])
    assert sorted(r["id"] for r in rows) == sorted(f"q{i}" for i in range(PROMPTS))
    assert all(isinstance(r["text"], str) and 0 <= r["tokens"] <= 6 for r in rows)
    err = capsys.readouterr().err
    assert f"prompts {PROMPTS}/{PROMPTS}" in err and "tok/s" in err and "ETA" in err
    assert main([*job["argv"], "--batch-size", "5"]) == 0  # nothing left: a no-op
    assert len(answered(job["out"])) == PROMPTS
    assert "all 12 prompts are answered" in capsys.readouterr().err


def test_plan_prints_the_choice_and_its_prediction_without_running(job: dict, capsys) -> None:
    assert main([*job["argv"], "--plan"]) == 0
    out = capsys.readouterr().out
    assert "chosen: batch" in out and "predicted" in out
    assert "| batch | prefill prompts per pass | pipeline |" in out
    assert not job["out"].exists()


def test_a_killed_run_resumes_and_answers_each_prompt_exactly_once(job: dict, capsys) -> None:
    env = {**os.environ, "MOEINF_CACHE": str(job["tmp"] / "cache")}
    child = subprocess.Popen([sys.executable, "-m", "moeinf.cli", *job["argv"], "--batch-size", "1"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and child.poll() is None:
            if job["out"].exists() and len(job["out"].read_bytes().splitlines()) >= 3:
                break
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        _, err = child.communicate()
    before = answered(job["out"])
    assert 3 <= len(before) < PROMPTS, err.decode()  # killed halfway, not before or after
    with job["out"].open("ab") as f:  # and as if the kill had cut a write in the middle
        f.write(b'{"id": "q11", "text": "cut sh')
    assert main([*job["argv"], "--batch-size", "1"]) == 0
    assert "dropped a partial last line" in capsys.readouterr().err
    after = answered(job["out"])
    assert after[:len(before)] == before  # nothing written before the kill was lost or changed
    ids = [r["id"] for r in after]
    assert sorted(ids) == sorted(f"q{i}" for i in range(PROMPTS))  # each exactly once


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such file"),
    ('{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": "b"\n', "prompts.jsonl:2: not valid JSON"),
    ('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', "prompts.jsonl:2: duplicate id 1"),
    ('{"id": 1}\n', "prompts.jsonl:1: missing key 'prompt'"),
])
def test_mistakes_in_the_prompts_file_are_one_line(job: dict, capsys, content: str | None,
                                                   message: str) -> None:
    if content is None:
        job["prompts"].unlink()
    else:
        job["prompts"].write_text(content)
    assert main(job["argv"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("moeinf batch: error:") and message in err


def test_an_out_that_is_a_directory_is_one_line_before_any_model_loads(job: dict, capsys) -> None:
    argv = list(job["argv"])
    argv[argv.index("--out") + 1] = str(job["tmp"])
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "is a directory; give a file's path" in err and "answers.jsonl" in err
    assert not (job["tmp"] / "store").exists()  # refused before the store was packed


def test_answers_beyond_the_context_are_refused_without_touching_out(job: dict, capsys) -> None:
    """The refusal came after --out was opened, leaving an empty answers file whose recorded settings
    were the refused ones."""
    capsys.readouterr()
    assert main([*job["argv"], "--max-new-tokens", "1000000"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "exceeds the model's context" in err
    assert not job["out"].exists() and not (job["tmp"] / "answers.jsonl.settings.json").exists()


def test_the_issues_command_as_written(tiny_model_dir, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`moeinf batch MODEL --prompts FILE.jsonl --out OUT.jsonl --device-cache 25%`, nothing else: each
    input line has `id` and `prompt`, each output line `id` and `text`."""
    monkeypatch.setenv("MOEINF_CACHE", str(tmp_path / "cache"))
    model = tiny_model_dir("qwen3_moe")
    prompts = tmp_path / "FILE.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"question {i}"}) + "\n" for i in range(3)))
    out = tmp_path / "OUT.jsonl"
    argv = ["batch", str(model), "--prompts", str(prompts), "--out", str(out), "--device-cache", "25%"]
    assert main(argv) == 0
    rows = answered(out)
    assert sorted(r["id"] for r in rows) == [0, 1, 2]
    assert all(isinstance(r["text"], str) for r in rows)


def test_a_rerun_with_other_settings_is_refused_before_loading(job: dict, capsys) -> None:
    """Resuming a file with another answer length, sampling or model would mix two jobs in one file."""
    assert main([*job["argv"], "--batch-size", "4"]) == 0
    rows = answered(job["out"])
    settings = json.loads((job["tmp"] / "answers.jsonl.settings.json").read_text())
    assert settings["--max-new-tokens"] == 6 and settings["--temperature"] == 0.0
    capsys.readouterr()
    longer = [*job["argv"], "--max-new-tokens", "9", "--temperature", "0.7"]
    assert main(longer) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--max-new-tokens 6 (now 9)" in err and "--temperature 0.0 (now 0.7)" in err
    assert answered(job["out"]) == rows  # nothing written
    assert main([*job["argv"], "--seed", "5"]) == 0  # greedy answers do not depend on the seed
    assert "all 12 prompts are answered" in capsys.readouterr().err
    job["out"].unlink()  # a new file takes any settings, and records them
    job["prompts"].write_text(json.dumps({"id": "x", "prompt": "hi"}) + "\n")
    assert main([*job["argv"], "--max-new-tokens", "3"]) == 0
    assert json.loads((job["tmp"] / "answers.jsonl.settings.json").read_text())["--max-new-tokens"] == 3
