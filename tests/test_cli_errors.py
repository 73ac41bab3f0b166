"""A user's mistake is one line on stderr naming the command, with a documented exit code, never a traceback;
--debug or MOEINF_DEBUG=1 shows the traceback. Every case goes through the CLI entry point."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moeinf.cli import main
from moeinf.commands.options import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE
from moeinf.store import pack


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> Path:
    return tiny_model_dir("qwen3_moe")


@pytest.fixture
def store(model: Path, tmp_path: Path) -> Path:
    out = tmp_path / "store"
    pack(model, out, progress=False)
    return out


def one_error_line(capsys: pytest.CaptureFixture[str], command: str) -> str:
    """The single stderr line of a failed command (after any informational lines), checked for form."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1, err
    assert errors[0].startswith(f"moeinf {command}: error: "), err
    assert lines[-1] == errors[0]
    return errors[0]


@pytest.mark.parametrize("command", ["trace", "chat", "generate", "serve"])
def test_missing_model_dir(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    extra = {"trace": ["--prompts", "x.jsonl", "--out", "x.eamc"], "generate": ["--prompt", "hi"]}
    assert main([command, str(tmp_path / "nope"), *extra.get(command, [])]) == EXIT_USAGE
    assert "does not exist" in one_error_line(capsys, command)


@pytest.mark.parametrize("command", ["trace", "chat", "generate"])
def test_directory_that_is_not_a_model(command: str, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    extra = {"trace": ["--prompts", "x.jsonl", "--out", "x.eamc"], "generate": ["--prompt", "hi"]}
    assert main([command, str(tmp_path), *extra.get(command, [])]) == EXIT_USAGE
    assert "no config.json" in one_error_line(capsys, command)


@pytest.mark.parametrize("text, said", [("{broken", "config.json is not valid JSON (Expecting property name "
                                                   "enclosed in double quotes at line 1 column 2)"),
                                        ("[1]", "config.json holds a JSON list, not an object")])
def test_a_config_json_that_is_not_a_json_object_is_named(text: str, said: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(text)
    assert main(["pack", str(tmp_path)]) == EXIT_USAGE
    assert f"{tmp_path}/{said}" in one_error_line(capsys, "pack")


@pytest.mark.parametrize("value, hint", [("abc", "cannot read 'abc'"), ("1", "'1GiB' or '1%'"),
                                         ("0.25", "'25%'"), ("150%", "at most 100%")])
@pytest.mark.parametrize("command", ["chat", "generate", "demo"])
def test_bad_device_cache(command: str, value: str, hint: str, model: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    args = {"chat": [str(model)], "generate": [str(model), "--prompt", "hi"], "demo": []}[command]
    assert main([command, *args, "--device-cache", value]) == EXIT_USAGE
    line = one_error_line(capsys, command)
    assert "--device-cache" in line and hint in line


@pytest.mark.parametrize("flag, value", [("--prefetch", "bogus"), ("--eviction", "fifo"),
                                         ("--max-new-tokens", "0"), ("--temperature", "-1"),
                                         ("--top-p", "2")])
@pytest.mark.parametrize("command", ["chat", "generate", "demo"])
def test_shared_flags_are_validated_alike(command: str, flag: str, value: str, model: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    args = {"chat": [str(model)], "generate": [str(model), "--prompt", "hi"], "demo": []}[command]
    assert main([command, *args, flag, value]) == EXIT_USAGE
    assert flag in one_error_line(capsys, command)


def test_zero_device_cache_names_the_knob(model: Path, store: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(model), "--prompt", "hi", "--device-cache", "0",
                 "--offload-dir", str(store)]) == EXIT_USAGE
    line = one_error_line(capsys, "generate")
    assert "--device-cache" in line and "device_cache" not in line  # the flag, not the config field


def test_config_field_names_become_flags_only_where_they_name_a_setting() -> None:
    from moeinf.cli import build_parser
    from moeinf.commands.options import flag_names

    generate = build_parser().commands["generate"]
    message = "device: 'cuda' was asked for but torch sees no CUDA device; use device='cpu'"
    assert flag_names(message, generate) == \
        "--device: 'cuda' was asked for but torch sees no CUDA device; use --device 'cpu'"
    assert flag_names("device_cache: 0 leaves no room; raise device_cache", generate) == \
        "--device-cache: 0 leaves no room; raise --device-cache"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_readable_line(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(model), "--prompt", "hi", "--device", "cuda"]) == EXIT_USAGE
    line = one_error_line(capsys, "generate")
    assert "--device" in line and "no CUDA device" in line


def test_prompt_longer_than_the_context_is_one_line(tmp_path: Path) -> None:
    """The tokenizer's own warning about a too-long sequence (a logging line transformers writes) does not
    precede moeinf's error: a subprocess, as transformers' log handler holds the real stderr."""
    env = {**os.environ, "MOEINF_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "moeinf", "generate", "demo", "--prompt", "word " * 5000,
                           "--max-new-tokens", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == EXIT_USAGE
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "exceeds the model's context" in lines[0], done.stderr


def test_empty_prompt(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(model), "--prompt", "", "--device-cache", "50%"]) == EXIT_USAGE
    assert "--prompt" in one_error_line(capsys, "generate")


def test_answer_longer_than_the_context_is_refused_before_loading(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "never-packed"
    assert main(["generate", str(model), "--prompt", "hi", "--max-new-tokens", "100000", "--device-cache",
                 "50%", "--offload-dir", str(store)]) == EXIT_USAGE
    assert "context" in one_error_line(capsys, "generate")
    assert not store.exists()


def test_truncated_expert_file(model: Path, store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    experts = next(store.glob("*.bin"))
    with open(experts, "r+b") as f:
        f.truncate(os.path.getsize(experts) // 2)
    code = main(["generate", str(model), "--prompt", "hi", "--max-new-tokens", "2", "--device-cache", "50%",
                 "--offload-dir", str(store)])
    # the store is found damaged and packed again (moeinf.store.pack), then used
    assert code == 0, capsys.readouterr().err
    assert os.path.getsize(experts) > 0 and main(["verify", str(store), "--no-progress"]) == 0


def test_truncated_dense_file(model: Path, store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dense = store / "dense.safetensors"
    with open(dense, "r+b") as f:
        f.truncate(os.path.getsize(dense) - 100)
    code = main(["generate", str(model), "--prompt", "hi", "--max-new-tokens", "2", "--device-cache", "50%",
                 "--offload-dir", str(store)])
    assert code == EXIT_FAILURE
    line = one_error_line(capsys, "generate")
    assert "dense.safetensors" in line or "truncated" in line
    # verify, as its help says, finds it too
    assert main(["verify", str(store), "--no-progress"]) == EXIT_FAILURE
    out = capsys.readouterr().out
    assert "dense.safetensors" in out and "truncated" in out
    assert "remov" not in out and "delete" not in out


def test_verify_of_a_model_directory_gives_no_advice_to_delete_it(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a copy: other tests may have packed the shared tiny model beside it, where verify would find a store
    alone = tmp_path / "model"
    shutil.copytree(model, alone)
    capsys.readouterr()
    assert main(["verify", str(alone), "--no-progress"]) == EXIT_FAILURE
    err = capsys.readouterr().err
    assert "has no packed store yet" in err and "moeinf pack" in err  # a model: its store is not packed
    assert "remov" not in err and "delete" not in err


def test_debug_shows_the_traceback(model: Path, store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (store / "dense.safetensors").write_bytes(b"garbage")
    args = ["generate", str(model), "--prompt", "hi", "--device-cache", "50%", "--offload-dir", str(store)]
    with pytest.raises(Exception):  # noqa: B017 - whatever the loader raises, --debug lets it through
        main([*args, "--debug"])
    monkeypatch.setenv("MOEINF_DEBUG", "1")
    with pytest.raises(Exception):  # noqa: B017
        main(args)


def test_unexpected_errors_are_one_line_pointing_at_debug(
        model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from moeinf.commands import options

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("something inside broke")

    monkeypatch.setattr(options, "check_context", broken)
    assert main(["generate", str(model), "--prompt", "hi", "--device-cache", "50%"]) == EXIT_FAILURE
    line = one_error_line(capsys, "generate")
    assert "something inside broke" in line and "--debug" in line


def test_ctrl_c_in_generate(model: Path, store: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    from moeinf.api import MoE

    def interrupted(self: MoE, *args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(MoE, "generate", interrupted)
    code = main(["generate", str(model), "--prompt", "hi", "--device-cache", "50%",
                 "--offload-dir", str(store)])
    assert code == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "moeinf generate: interrupted"


def test_ctrl_c_in_pack_leaves_nothing_half_written(model: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    pack_module = importlib.import_module("moeinf.store.pack")

    class InterruptedBar:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def __enter__(self) -> InterruptedBar:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def update(self, n: int) -> None:
            raise KeyboardInterrupt

    monkeypatch.setattr(pack_module, "progress_bar", InterruptedBar)
    out = tmp_path / "out" / "store"
    assert main(["pack", str(model), "--offload-dir", str(out)]) == EXIT_INTERRUPTED
    assert capsys.readouterr().err.strip().splitlines()[-1] == "moeinf pack: interrupted"
    assert not out.exists() and list(out.parent.iterdir()) == []


def test_a_real_process_exits_2_with_one_line(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "moeinf.cli", "chat", str(tmp_path / "nope")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_USAGE
    assert result.stderr.strip().count("\n") == 0 and "moeinf chat: error:" in result.stderr


def test_help_shows_defaults_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--help"]) == 0
    out = capsys.readouterr().out
    from moeinf.config import OffloadConfig

    assert "(default: 128)" in out and f"(default: {OffloadConfig.prefetch})" in out and "exit codes" in out
    assert "--cache" not in out.replace("--device-cache", "").replace("--host-cache", "")


def test_bench_help_lists_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    from moeinf.commands.bench import BENCHMARKS

    assert main(["bench", "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name, text in BENCHMARKS.items():
        assert f"  {name:<17}{text}" in lines, name


def test_chat_refuses_an_answer_length_that_leaves_no_room_for_a_message(model: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from moeinf.commands.options import context_length

    limit = context_length(model)
    assert limit is not None
    assert main(["chat", str(model), "--max-new-tokens", str(limit)]) == EXIT_USAGE
    line = one_error_line(capsys, "chat")
    assert f"--max-new-tokens {limit} leaves no room for a message in the model's context of {limit}" in line
    assert line.endswith(f"at most {limit - 1}")
