"""The input of a batch job (a JSON-lines file of prompts) and its resumable output.

Input: one JSON object per line with a unique `id` (string or integer) and a `prompt` (string); other keys
are ignored. Blank lines are skipped. A mistake is a `JobError` naming the file and the line.

Output: one JSON object per answered prompt, `{"id": ..., "text": ...}` plus optional fields, appended,
flushed and fsynced as each prompt finishes, so a killed run loses at most the prompts in flight. On
reopening, the answered ids are read back; a last line without its newline (a write cut by the kill) is
truncated away, and the prompts it held are answered again. Each id therefore appears exactly once.

Beside the answers, `ANSWERS.settings.json` records what shapes an answer (the model, the answer's length,
sampling, the stores' precision): a rerun that resumes a file must ask for the same, or the file would mix
answers of two jobs (`Answers.check_settings`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

Id = str | int


class JobError(ValueError):
    """The prompts file or the answers file is not what a batch job needs; the message says where."""


@dataclass(frozen=True)
class Prompt:
    id: Id
    prompt: str


SETTINGS = frozenset({"max_tokens", "max_new_tokens", "max_completion_tokens", "temperature", "top_p",
                      "top_k", "stop", "seed", "repetition_penalty", "n"})
"""Keys of a prompt line that would ask for per-prompt generation settings, which a job does not have:
refused by name rather than ignored. Other extra keys (a task, a source) are the user's and stay."""


def read_prompts(path: str | Path) -> list[Prompt]:
    """The prompts of `path` in file order; raises `JobError` on a missing file, a line that is not a JSON
    object, a missing or mistyped `id`/`prompt`, a per-prompt setting (`SETTINGS`), or an id given twice."""
    path = Path(path)
    if not path.is_file():
        raise JobError(f"{path}: no such file (give a JSON-lines file with 'id' and 'prompt' on each line)")
    prompts: list[Prompt] = []
    seen: dict[Id, int] = {}
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise JobError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(item, dict):
                raise JobError(f"{where}: a line must be a JSON object with 'id' and 'prompt'")
            for key in ("id", "prompt"):
                if key not in item:
                    chat = " (a line holds one plain prompt; chat 'messages' are not read)" if (
                        key == "prompt" and "messages" in item) else ""
                    raise JobError(f"{where}: missing key {key!r}{chat}")
            settings = sorted(SETTINGS & item.keys())
            if settings:
                raise JobError(f"{where}: {settings[0]!r} is not read per prompt: every prompt is answered "
                               "with the command's settings (--max-new-tokens, --temperature, ...); drop it, "
                               "or answer the prompts that need other settings as another job")
            key = item["id"]
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise JobError(f"{where}: 'id' must be a string or an integer, not {type(key).__name__}")
            if not isinstance(item["prompt"], str):
                raise JobError(f"{where}: 'prompt' must be a string")
            if key in seen:
                raise JobError(f"{where}: duplicate id {key!r} (first on line {seen[key]})")
            seen[key] = number
            prompts.append(Prompt(key, item["prompt"]))
    if not prompts:
        raise JobError(f"{path}: holds no prompts")
    return prompts


class Answers:
    """The answers file of a job, opened for appending (see the module docstring).

    `done` holds the ids already answered (after recovery); `write` appends one answer durably.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.done: set[Id] = set()
        self.dropped_partial = False
        """Whether opening truncated a partial last line (a write cut by a kill)."""
        self._file: BinaryIO = open(self.path, "a+b")  # noqa: SIM115 (closed by close/__exit__)
        try:
            self._recover()
        except BaseException:
            self._file.close()
            raise

    def _recover(self) -> None:
        self._file.seek(0)
        data = self._file.read()
        end = data.rfind(b"\n") + 1  # bytes up to and including the last complete line
        if end < len(data):
            self._file.truncate(end)
            os.fsync(self._file.fileno())
            self.dropped_partial = True
        for number, line in enumerate(data[:end].splitlines(), start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                raise JobError(f"{self.path}:{number}: not an answers line (not JSON); give another --out "
                               "or remove the file") from None
            if not isinstance(item, dict) or "id" not in item:
                raise JobError(f"{self.path}:{number}: an answers line has no 'id'; give another --out")
            self.done.add(item["id"])

    @property
    def settings_path(self) -> Path:
        """Where the settings of this file's answers are recorded."""
        return self.path.with_name(self.path.name + ".settings.json")

    def check_settings(self, settings: dict[str, Any]) -> None:
        """Refuse (`JobError`, each difference named by its key: name them as the user sets them) to add
        answers made with other `settings` than those recorded for the answers already in the file; else
        record `settings` beside the file. A file with answers but no record (written before records were
        kept) is taken as it is."""
        settings = json.loads(json.dumps(settings))  # the form it is recorded in (tuples as lists)
        if self.done and self.settings_path.is_file():
            try:
                recorded = json.loads(self.settings_path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                recorded = None
            if not isinstance(recorded, dict):
                raise JobError(f"{self.settings_path}: unreadable; remove it to resume {self.path} as it is, "
                               "or give another --out")
            changed = [f"{key} {recorded[key]} (now {value})" for key, value in settings.items()
                       if key in recorded and recorded[key] != value]
            if not changed and recorded != settings:  # only which settings apply differs
                changed = [f"the settings in {self.settings_path}"]
            if changed:
                raise JobError(f"{self.path} holds answers made with {', '.join(changed)}; rerun with those "
                               "settings to resume it, or give another --out")
        partial = self.settings_path.with_name(self.settings_path.name + ".partial")
        partial.write_text(json.dumps(settings, indent=1) + "\n", encoding="utf-8")
        os.replace(partial, self.settings_path)

    def pending(self, prompts: Iterable[Prompt]) -> list[Prompt]:
        """The prompts not answered yet, in their order."""
        return [p for p in prompts if p.id not in self.done]

    def write(self, key: Id, text: str, **extra: Any) -> None:
        """Append the answer of `key` and make it durable before returning."""
        if key in self.done:
            raise ValueError(f"id {key!r} is already answered in {self.path}")
        line = json.dumps({"id": key, "text": text, **extra}, ensure_ascii=False) + "\n"
        self._file.write(line.encode("utf-8"))
        self._file.flush()
        os.fsync(self._file.fileno())
        self.done.add(key)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Answers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
