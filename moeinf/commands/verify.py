"""Re-read every expert blob of a store and check its size and checksum, and check the dense weights file
(a whole safetensors file: readable header, every tensor inside the file with the bytes its shape needs).
Exit status 0 when everything is good, 1 naming each bad expert (layer, expert, file, offset) or file.
Nothing is changed or deleted."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store_dir", metavar="STORE_DIR", help="a store written by `moeinf pack`")
    parser.add_argument("--json", action="store_true", help="print the problems as JSON on stdout")
    parser.add_argument("--no-progress", action="store_true",
                        help="do not show progress (a bar in a terminal, else a log line every 10 s)")


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from moeinf.store import StoreError, unchecked, verify

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
