"""Polling with a deadline: a test that waits for another thread fails with a message instead of hanging."""

from __future__ import annotations

import time
from collections.abc import Callable

DEADLINE_S = 30.0


def until(condition: Callable[[], bool], what: str, timeout: float = DEADLINE_S, poll: float = 0.0) -> None:
    """Return once `condition()` holds; fail the test naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        if poll:
            time.sleep(poll)
