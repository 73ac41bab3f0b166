"""The `moeinf` command. Each subcommand lives in `moeinf/commands/<name>.py` and defines
`add_arguments(parser)` and `run(args) -> int`; this module only dispatches, so `--help` stays fast."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from . import __version__

# name -> one-line help; the module moeinf.commands.<name> implements it.
COMMANDS: dict[str, str] = {
    "pack": "convert a HuggingFace checkpoint into an expert store",
    "verify": "re-read every expert of a store and check its checksum",
    "trace": "generate on prompt sets, record expert activations, build an EAMC",
    "generate": "generate text from a prompt with experts offloaded",
    "chat": "interactive terminal chat with streaming output",
    "serve": "OpenAI-compatible HTTP server",
    "replay": "replay an Azure LLM inference trace and measure latency",
    "bench": "benchmarks: io, eamc, cache, prefetch, e2e, all",
    "demo": "train (or reuse) a small MoE, offload it and answer a few prompts",
    "zoo": "zoo models: inflate one to big-model expert geometry",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moeinf",
        description="Run Mixture-of-Experts models whose experts live on SSD, with activation-aware "
        "prefetching and caching.",
    )
    parser.add_argument("--version", action="version", version=f"moeinf {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        try:
            module = importlib.import_module(f"moeinf.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"moeinf.commands.{name}":
                raise
            continue
        cmd = sub.add_parser(name, help=help_text, description=module.__doc__ or help_text,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
