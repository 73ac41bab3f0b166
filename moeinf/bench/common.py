"""What every benchmark records beside its figures: the machine, results as JSON lines, and the round
whose figure is the median."""

from __future__ import annotations

import json
import logging
import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def machine() -> dict[str, Any]:
    """The machine a result was measured on (platform, CPUs, CPU model, memory, Python, numpy)."""
    info: dict[str, Any] = {"platform": platform.platform(), "machine": platform.machine(),
                            "cpus": os.cpu_count(), "python": platform.python_version(),
                            "numpy": np.__version__}
    try:
        with open("/proc/cpuinfo") as f:
            models = (line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
            info["cpu"] = next(models, "")
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError as exc:
        log.debug("no /proc machine info: %s", exc)
    return info


def offload_settings(pairs: Sequence[str]) -> dict[str, Any]:
    """KEY=VALUE pairs as OffloadConfig fields (each value read as JSON where it parses, else as a string);
    ValueError, naming the pair, for an unknown key or a value the config refuses."""
    from moeinf.config import ConfigError, OffloadConfig

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in OffloadConfig.__dataclass_fields__:
            raise ValueError(f"{pair!r}: give KEY=VALUE with KEY an OffloadConfig field")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    try:
        OffloadConfig(**out)  # refuse a bad value before anything runs
    except (ConfigError, TypeError) as exc:
        raise ValueError(f"{' '.join(pairs)}: {exc}") from None
    return out


def count_problem(args: Any, positive: Sequence[str] = (), non_negative: Sequence[str] = ()) -> str | None:
    """What is wrong with the first count option below its bound (`positive`: >= 1, `non_negative`: >= 0;
    attribute names of `args`, None meaning unset), or None."""
    for names, low in ((positive, 1), (non_negative, 0)):
        for name in names:
            value = getattr(args, name)
            if value is not None and value < low:
                return f"--{name.replace('_', '-')} must be >= {low}, got {value}"
    return None


def refuse_counts(command: str, args: Any, positive: Sequence[str] = (),
                  non_negative: Sequence[str] = ()) -> None:
    """Exit in one line, before any work, when a count option of `moeinf bench COMMAND` is below its bound
    (`count_problem`)."""
    problem = count_problem(args, positive, non_negative)
    if problem:
        raise SystemExit(f"moeinf bench {command}: error: {problem}")


def median_round(rounds: Sequence[dict[str, Any]], key: str) -> dict[str, Any]:
    """Of several rounds of one measurement, the one whose `key` is the median (the lower of the two
    middle ones for an even count): its details stand for all of them."""
    return sorted(rounds, key=lambda r: r[key])[(len(rounds) - 1) // 2]


def write_jsonl(path: Path, rows: Sequence[dict[str, Any]], header: dict[str, Any]) -> None:
    """One JSON object per result, each carrying the run's configuration and machine."""
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps({**header, **row}) + "\n")


def emit(name: str, results: list[dict[str, Any]], header: dict[str, Any], *, out: str | None, as_json: bool,
         plot: Callable[[Path, list[dict[str, Any]], dict[str, Any]], None],
         table: Callable[[list[dict[str, Any]], dict[str, Any]], str]) -> None:
    """Write `<out>/<name>.jsonl` and `<name>.png` when `out` is given, then print JSON or a table."""
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        write_jsonl(folder / f"{name}.jsonl", results, header)
        plot(folder / f"{name}.png", results, header)
    if as_json:
        print(json.dumps({**header, "results": results}))
    else:
        print(table(results, header))
