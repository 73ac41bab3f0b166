"""Re-read every expert blob of a store and check its size and checksum, and check the dense weights file
(a whole safetensors file: readable header, every tensor inside the file with the bytes its shape needs).
Exit status 0 when everything is good, 1 naming each bad expert (layer, expert, file, offset) or file.
Nothing is changed or deleted."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store_dir", metavar="STORE_DIR",
                        help="a store written by `moeinf pack`, or the model it was packed from (a "
                             "checkpoint directory or a zoo name such as demo): then its store, where "
                             "`moeinf pack` puts it")
    parser.add_argument("--json", action="store_true", help="print the problems as JSON on stdout")
    parser.add_argument("--no-progress", action="store_true",
                        help="do not show progress (a bar in a terminal, else a log line every 10 s)")


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from moeinf.store import StoreError, unchecked, verify
    from moeinf.store.index import INDEX_NAME

    if not (Path(args.store_dir) / INDEX_NAME).is_file():
        found = store_of(args.store_dir)
        if found is not None:
            print(f"verifying {found}, the store of {args.store_dir}", file=sys.stderr)
            args.store_dir = str(found)
        elif names_a_model(args.store_dir):
            print(f"moeinf verify: error: {args.store_dir} has no packed store yet; pack it first "
                  f"(`moeinf pack {args.store_dir}`) or give the STORE_DIR it was packed into",
                  file=sys.stderr)
            return 1
    try:
        skipped = unchecked(args.store_dir)
        problems = verify(args.store_dir, progress=not args.no_progress)
    except StoreError as exc:
        print(f"moeinf verify: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"store_dir": args.store_dir, "ok": not problems,
                          "problems": [asdict(p) for p in problems], "unchecked": skipped}))
    elif problems:
        for problem in problems:
            print(f"BAD {problem}")
        print(f"{len(problems)} problem(s) in {args.store_dir}; pack the model again into a new directory "
              "with `moeinf pack SRC_DIR NEW_STORE_DIR`")
    else:
        checked = "the experts" if skipped else "all experts and the dense weights"
        print(f"{args.store_dir}: {checked} are good")
    if skipped and not args.json:
        print(f"UNCHECKED {', '.join(skipped)}: this store was packed by an older moeinf without a checksum "
              "for it; pack the model again into a new directory (`moeinf pack SRC_DIR NEW_STORE_DIR`) to "
              "check every byte")
    return 1 if problems else 0


def store_of(text: str) -> Path | None:
    """The packed store the other commands use for the model `text` names (a checkpoint directory, or a
    shipped or cached zoo model): its exact store first, then int8, then int4, each where `moeinf pack`
    puts it (`default_store`). None when there is none; nothing is trained, downloaded or packed to find
    it."""
    from moeinf.hub import ModelRefError, resolve_model
    from moeinf.store.index import INDEX_NAME
    from moeinf.zoo import model_dir, problems, shipped_dir
    from moeinf.zoo.train import RECIPES

    from .options import model_arg
    from .pack import default_store

    path = Path(text).expanduser()
    if text in RECIPES and not path.exists():  # a zoo name: its checkpoint only if shipped or cached
        present = [d for d in (shipped_dir(text), model_dir(text)) if d.is_dir() and not problems(d, text)]
        if not present:
            return None
        path = present[0]
    if not (path.is_dir() and (path / "config.json").is_file()):
        return None
    try:
        model = model_arg(resolve_model(path, progress=False))
    except ModelRefError:
        return None
    candidates = [default_store(model, quant) for quant in (None, "int8", "int4")]
    return next((c for c in candidates if (c / INDEX_NAME).is_file()), None)


def names_a_model(text: str) -> bool:
    """Whether `text` is a checkpoint directory or a zoo model's name."""
    from moeinf.zoo.train import RECIPES

    return text in RECIPES or (Path(text).expanduser() / "config.json").is_file()
