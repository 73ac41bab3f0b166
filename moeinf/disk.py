"""Free disk space, checked before long writes (`moeinf zoo synth`, `moeinf pack`), so that a command that
cannot finish says so at once, in one line naming what it needs, instead of failing with "No space left on
device" after minutes of work.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def free_bytes(path: str | Path) -> int:
    """Bytes free to an unprivileged writer on the file system that holds `path` (or, if `path` does not
    exist yet, its nearest existing ancestor)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def shortfall(path: str | Path, need: int, what: str) -> str | None:
    """None when `need` bytes fit at `path`; else one sentence saying what needs how much and what is free.
    `what` names the writing step ("the store", "the checkpoint")."""
    free = free_bytes(path)
    if need <= free:
        return None
    return f"{what} needs {size(need)} at {path} and {size(free)} are free there"


def size(nbytes: float) -> str:
    """A byte count for people: 31.4 GB, 23.1 MB, 512 B (powers of 1000, as drives are sold)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"
