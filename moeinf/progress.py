"""Progress of long work that shows wherever the output goes: a tqdm bar in a terminal, periodic log lines
otherwise (a log file, CI, a pipe), where a bar would either print nothing or fill the log with
carriage returns.

    with progress_bar(total=n, desc="pack", unit="B") as bar:
        for ...:
            bar.update(k)

Log lines go to the `moeinf.progress` logger at INFO, one every `PROGRESS_EVERY_S` seconds and one at the
end; the CLI shows INFO lines of this logger (cli.main), and a program using the API sees them with
`logging.basicConfig(level=logging.INFO)`.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 10.0
"""Seconds between two log lines of progress when stderr is not a terminal."""


class LogProgress:
    """The part of tqdm's interface moeinf uses (update, set_postfix_str, close, a context manager),
    reporting as log lines every `every_s` seconds."""

    def __init__(self, total: float | None, desc: str, unit: str = "it", unit_scale: bool = False,
                 every_s: float | None = None) -> None:
        self.total, self.desc, self.unit, self.unit_scale = total, desc, unit, unit_scale
        self.every_s = PROGRESS_EVERY_S if every_s is None else every_s
        self.n = 0.0
        self.postfix = ""
        self.start = self.last = time.monotonic()
        self.closed = False

    def _amount(self, n: float) -> str:
        if self.unit_scale and self.unit == "B":
            return f"{n / 2**20:.1f} MiB"
        return f"{n:g} {self.unit}"

    def line(self) -> str:
        elapsed = time.monotonic() - self.start
        done = self._amount(self.n)
        if self.total:
            share = self.n / self.total
            text = f"{self.desc}: {share:.0%} ({done} of {self._amount(self.total)}), {elapsed:.0f} s"
            if 0 < share < 1:
                text += f", about {elapsed * (1 - share) / share:.0f} s left"
        else:
            text = f"{self.desc}: {done}, {elapsed:.0f} s"
        return f"{text} [{self.postfix}]" if self.postfix else text

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            log.info("%s", self.line())

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True,
                    **kwargs: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in {**(ordered_dict or {}), **kwargs}.items())

    def set_description(self, desc: str, refresh: bool = True) -> None:
        self.desc = desc

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            log.info("%s (done)", self.line())

    def __enter__(self) -> LogProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_bar(total: float | None = None, *, desc: str, unit: str = "it", unit_scale: bool = False,
                 enabled: bool = True, every_s: float | None = None) -> Any:
    """A tqdm bar on a terminal's stderr, else `LogProgress` (a line every `every_s`, default
    `PROGRESS_EVERY_S`); a silent bar when not `enabled`."""
    from tqdm import tqdm

    if not enabled:
        return tqdm(total=total, disable=True)
    if sys.stderr.isatty():
        return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=sys.stderr)
    return LogProgress(total, desc, unit, unit_scale, PROGRESS_EVERY_S if every_s is None else every_s)
