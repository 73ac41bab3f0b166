"""The README's commands and Python example are the ones that work: the example is executed as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moeinf import zoo

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_first_command_sets_up_and_runs_the_demo() -> None:
    assert blocks("bash")[0].strip() == (
        "python3 -m venv .venv && . .venv/bin/activate && bash scripts/setup.sh && moeinf demo")


def test_python_example_runs_as_written(tmp_path: Path) -> None:
    (code,) = blocks("python")
    cache = tmp_path / "cache"
    shipped = zoo.shipped_dir("full")
    if not shipped.is_dir() or zoo.problems(shipped, "full"):
        # Without the shipped full model the example would train it for 85 minutes: run it on the tiny
        # variant instead (the only change), trained into a private cache first.
        assert code.count('"full"') == 2
        code = code.replace('"full"', '"tiny"')
        zoo.get_model("tiny", cache_dir=cache, threads=1, progress=False)
    env = dict(os.environ, MOEINF_CACHE=str(cache))
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "'hits'" in result.stdout and "'prefetch_recall'" in result.stdout


@pytest.mark.parametrize("name", ["MOEINF_CACHE", "MOEINF_DEBUG", "/health", "/metrics",
                                  "/v1/chat/completions"])
def test_environment_and_endpoints_are_documented(name: str) -> None:
    assert name in README.read_text(encoding="utf-8")


def section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n### {title}\n")
    return text[start:text.index("\n##", start + 1)]


def test_the_commands_table_matches_the_command_line() -> None:
    """Every command is in the table and every row's command, arguments and flags are the ones --help shows
    (the table said `moeinf replay --model MODEL` after replay took MODEL as its first argument)."""
    import argparse

    from moeinf.cli import COMMANDS, build_parser
    from moeinf.commands.bench import BENCHMARKS

    parser = build_parser()
    rows = re.findall(r"^\| `moeinf (\w+)([^`]*)` \| (.*) \|$", section("Command line"), flags=re.M)
    assert sorted(name for name, _, _ in rows) == sorted(COMMANDS)
    for name, usage, text in rows:
        command = parser.commands[name]
        positionals = [a.metavar for a in command._actions
                       if not a.option_strings and a.nargs != argparse.REMAINDER]
        words = usage.split()
        written = [w for i, w in enumerate(words)  # the arguments, not the values of flags
                   if w.upper() == w and w.strip("_").isalpha()
                   and not (i and words[i - 1].startswith("--"))]
        assert written == positionals[: len(written)], (name, written, positionals)
        flags = set(re.findall(r"(--[a-z][a-z-]*)", usage + " " + text))
        unknown = flags - set(command._option_string_actions)
        assert not unknown, (name, unknown)
        old = {f for f in flags if command._option_string_actions[f].help in (argparse.SUPPRESS, None)
               or "deprecated" in command._option_string_actions[f].help}
        assert not old, (name, old)  # an old spelling, kept working, is not what the README teaches
        if name == "bench":
            assert re.findall(r"`([\w-]+)`", text.split(";")[0]) == [*BENCHMARKS, "all"]
        if name == "zoo":
            (sub,) = [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]
            assert usage.split()[0].split("\\|") == list(sub.choices)


def test_the_flags_section_matches_the_shared_flags() -> None:
    """The flags the README lists are the shared flags every command takes, with the defaults it states."""
    from moeinf.cli import build_parser
    from moeinf.commands.options import DEFAULT_DEVICE_CACHE
    from moeinf.config import OffloadConfig

    text = section("Flags")
    listed = set(re.findall(r"`(--[a-z][a-z-]*)", text))
    generate = build_parser().commands["generate"]
    shared = {s for a in generate._actions for s in a.option_strings
              if s.startswith("--") and a.help != "==SUPPRESS==" and a.container.title in (
                  "generation", "offloading (fields of OffloadConfig)")}
    assert listed - {"--debug"} == shared
    assert f"default: {DEFAULT_DEVICE_CACHE} of the expert bytes" in " ".join(text.split())
    assert f"(defaults `{OffloadConfig.prefetch}` and `{OffloadConfig.eviction}`)" in text
