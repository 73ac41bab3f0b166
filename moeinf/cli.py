"""The `moeinf` command. Each subcommand lives in `moeinf/commands/<name>.py` and defines
`add_arguments(parser)` and `run(args) -> int`; this module only dispatches, so `--help` stays fast.

It is also the one place where errors become what a user reads: one line on stderr naming the command,
and an exit code (moeinf.commands.options: 1 failure, 2 usage, 130 Ctrl-C). `--debug` or
MOEINF_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys

from . import __version__
from .commands import options
from .commands.options import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    HelpFormatter,
    Parser,
    UsageError,
)
from .config import ConfigError
from .kernels import openmp

DEBUG_ENV = "MOEINF_DEBUG"
EPILOG = f"""exit codes: 0 success; 1 the work failed or found problems; 2 a mistake in the command line;
130 interrupted (Ctrl-C). Run with --debug (or {DEBUG_ENV}=1) to see the traceback of an error.
environment: MOEINF_CACHE (zoo models and their stores; default ~/.cache/moeinf), {DEBUG_ENV}."""

# name -> one-line help; the module moeinf.commands.<name> implements it.
COMMANDS: dict[str, str] = {
    "pack": "convert a HuggingFace checkpoint into an expert store",
    "verify": "re-read every expert of a store and check its checksum",
    "trace": "generate on prompt sets, record expert activations, build an EAMC",
    "generate": "generate text from a prompt with experts offloaded",
    "chat": "interactive terminal chat with streaming output",
    "serve": "OpenAI-compatible HTTP server",
    "replay": "replay an Azure LLM inference trace and measure latency",
    "bench": "benchmarks: cache, e2e, scale, batch-throughput, ... (moeinf bench --help lists all)",
    "demo": "train (or reuse) a small MoE, offload it and answer a few prompts",
    "zoo": "zoo models: inflate one to big-model expert geometry",
    "batch": "answer a JSON-lines file of prompts offline, in planned batches (resumable)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="moeinf",
        description="Run Mixture-of-Experts models whose experts live on SSD, with activation-aware "
        "prefetching and caching.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"moeinf {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages to stderr")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = {}
    for name, help_text in COMMANDS.items():
        try:
            module = importlib.import_module(f"moeinf.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"moeinf.commands.{name}":
                raise
            continue
        cmd = sub.add_parser(name, help=help_text, description=module.__doc__ or help_text,
                             formatter_class=HelpFormatter, epilog=EPILOG)
        module.add_arguments(cmd)
        # SUPPRESS: `moeinf --debug CMD` is not reset to False by the subcommand's default.
        cmd.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="show the traceback of an error (or set MOEINF_DEBUG=1)")
        cmd.set_defaults(_run=module.run)
        parser.commands[name] = cmd
    return parser


def main(argv: list[str] | None = None) -> int:
    openmp.prefer_passive_wait()  # before a command loads torch: idle OpenMP threads must not hold the cores
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed in one line
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:  # progress lines of long work when stderr is not a terminal (moeinf.progress)
        logging.getLogger("moeinf.progress").setLevel(logging.INFO)
    args.argv = argv  # the command line as given (a report records it)
    if not getattr(args, "_run", None):
        parser.print_help()
        return EXIT_USAGE
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    from .parallel import ep

    if ep.is_follower():  # torchrun's ranks 1..: serve experts for rank 0, which runs the command
        return ep.follow()
    try:
        options.check_no_offload(args, parser.commands[args.command])
        options.resolve_model_args(args)
        code = int(args._run(args) or 0)
        if code == 0:
            ep.release_followers()  # (a failing rank 0 makes torchrun stop the others)
        return code
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"\nmoeinf {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if debug:
            raise
        code, message = describe(exc)
        if isinstance(exc, ConfigError):  # name the flags the user wrote, not the config's fields
            message = options.flag_names(message, parser.commands[args.command])
        command = f"bench {args.name}" if args.command == "bench" else args.command  # the benchmark's name
        print(f"moeinf {command}: error: {message}", file=sys.stderr)
        return code


def describe(exc: Exception) -> tuple[int, str]:
    """(exit code, one line) for an error escaping a command."""
    from .spec import UnsupportedModelError
    from .store import StoreError

    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, (UsageError, ConfigError, UnsupportedModelError)):
        return EXIT_USAGE, text
    if isinstance(exc, (StoreError, OSError, json.JSONDecodeError)):
        return EXIT_FAILURE, text
    if type(exc).__name__ == "SafetensorError":
        return EXIT_FAILURE, f"unreadable safetensors file ({text}); the file is truncated or corrupt"
    return EXIT_FAILURE, f"{type(exc).__name__}: {text} (run with --debug for the traceback)"


if __name__ == "__main__":
    sys.exit(main())
