from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from moeinf.cli import main


def test_generate_prints_json_text_and_stats(tiny_model_dir, tmp_path: Path, capsys) -> None:
    model_dir = tiny_model_dir("qwen3_moe")
    code = main(["generate", str(model_dir), "--prompt", "Hello", "--max-new-tokens", "4", "--cache", "30%",
                 "--offload-dir", str(tmp_path / "store"), "--eviction", "lru", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["ids"]) == 4
    assert isinstance(report["text"], str)
    assert report["stats"]["tokens"] == 4
    assert report["stats"]["hits"] + report["stats"]["misses"] == report["stats"]["accesses"]


def test_generate_refuses_a_tiny_cache_naming_the_flag(tiny_model_dir, tmp_path: Path, capsys) -> None:
    code = main(["generate", str(tiny_model_dir("qwen3_moe")), "--prompt", "Hi", "--device-cache", "1KiB",
                 "--offload-dir", str(tmp_path / "store")])
    assert code == 2
    assert "--device-cache >=" in capsys.readouterr().err


class Stdin(io.StringIO):
    """A stand-in for sys.stdin: piped text, or a terminal."""

    def __init__(self, text: str = "", tty: bool = False) -> None:
        super().__init__(text)
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_the_prompt_may_come_from_a_file_or_stdin(tiny_model_dir, tmp_path: Path, capsys,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """--prompt-file, --prompt - and a piped stdin give the tokens of the same --prompt (one trailing newline
    dropped, as echo and editors add it)."""
    common = [str(tiny_model_dir("qwen3_moe")), "--max-new-tokens", "3", "--device-cache", "50%",
              "--offload-dir", str(tmp_path / "store"), "--json"]

    def ids(*argv: str, stdin: str = "") -> list[int]:
        monkeypatch.setattr(sys, "stdin", Stdin(stdin))
        assert main(["generate", *common, *argv]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["prompt"] == "Hello there"
        return report["ids"]

    question = tmp_path / "q.txt"
    question.write_text("Hello there\n")
    expected = ids("--prompt", "Hello there")
    assert ids("--prompt-file", str(question)) == expected
    assert ids("--prompt", "-", stdin="Hello there\n") == expected
    assert ids(stdin="Hello there\n") == expected


@pytest.mark.parametrize(("argv", "stdin", "message"), [
    ([], Stdin(tty=True), "give the prompt: --prompt TEXT, --prompt-file FILE, or pipe it on stdin"),
    ([], Stdin("\n"), "the prompt on stdin is empty"),
    (["--prompt-file", "missing.txt"], Stdin(tty=True), "--prompt-file missing.txt: no such file"),
])
def test_no_prompt_is_one_line(tiny_model_dir, capsys, monkeypatch: pytest.MonkeyPatch, argv: list[str],
                               stdin: Stdin, message: str) -> None:
    monkeypatch.setattr(sys, "stdin", stdin)
    capsys.readouterr()
    assert main(["generate", str(tiny_model_dir("qwen3_moe")), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
