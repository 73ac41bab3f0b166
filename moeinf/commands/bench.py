"""Benchmarks. `moeinf bench NAME [ARGS...]` runs the benchmark `moeinf/bench/NAME.py`; `moeinf bench NAME
--help` lists its arguments. `moeinf bench all [ARGS...]` runs every available benchmark with the same
own arguments (quick or full, `--quick`) and writes DIR/report.md (`moeinf bench all --help`).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from types import ModuleType

from moeinf.commands import options

# name -> one-line help; moeinf.bench.<name> implements it with add_arguments(parser) and run(args) -> int.
BENCHMARKS: dict[str, str] = {
    "io": "expert I/O engine against raw O_DIRECT reads of a store",
    "eamc": "EAMC matching and prediction accuracy",
    "cache": "expert cache hit rates of the eviction policies",
    "prefetch": "prefetch policies: coverage and latency",
    "e2e": "end-to-end generation latency and throughput",
    "accelerate": "per-token latency of HuggingFace + accelerate disk offload",
    "quant": "quantised expert stores: kernel choice and quality against the exact model",
    "llamacpp": "llama.cpp (bf16, Q8_0, Q4_0) beside moeinf on the same checkpoint (needs moeinf[llamacpp])",
    "exact": "bit-exactness against HF: every family x dtype x cache x prefetch/eviction pair",
    "overhead": "decode ms/token with every expert resident, against HF on the same model",
    "batch": "decode step cost of a batch of rows against one row (does batching pay?)",
    "ep": "expert parallelism: ms/token at 1 and 2 ranks, bytes exchanged, placement balance",
    "scale": "a model bigger than the machine: every system under the same cgroup memory cap",
    "soak": "bursts of concurrent requests with bad ones mixed in: server RSS per burst, 200s and 4xx",
    "batch-throughput": "offline batches (moeinf batch) vs one at a time, serve and accelerate: tokens/s",
}
__doc__ += "\n" + "\n".join(f"  {name:<17}{text}" for name, text in BENCHMARKS.items()) + "\n"
# benchmarks whose module name differs from the benchmark name
MODULES: dict[str, str] = {"accelerate": "accelerate_baseline", "batch-throughput": "batch_throughput"}

DEVICE_CACHE: dict[str, tuple[str, str]] = {
    "e2e": ("--cache", "sizes"), "exact": ("--caches", "sizes-or-min"), "llamacpp": ("--budgets", "sizes"),
    "quant": ("--cache", "size"), "batch": ("--device-cache", "size"), "ep": ("--device-cache", "size"),
    "batch-throughput": ("--device-cache", "size"),
    "accelerate": ("--cache", "share"), "prefetch": ("--cache-fraction", "share"),
}
"""Benchmark -> (the flag its module defines for the experts' budget in the compute tier, what that flag
takes). `moeinf bench NAME --device-cache` sets it with the meaning it has in every command: a size
('4GiB') or a share of the model's expert bytes ('25%'); several comma-separated where the benchmark runs
each ("sizes-or-min": also `min`, the smallest cache the benchmark runs). The module's own spelling still
works, saying it is deprecated."""
NO_DEVICE_CACHE: dict[str, str] = {
    "io": "it times the I/O engine reading the store, with no expert cache",
    "eamc": "it scores EAMC predictions, with no expert cache",
    "cache": "it sweeps cache sizes of its own (--quick: three)",
    "overhead": "it keeps every expert resident by design",
    "scale": "each system gets the memory --memory-cap leaves it (--overhead)",
    "soak": "it measures the server's memory; give the server's flag with --server-arg=--device-cache=SIZE",
    "prefetch_live": "it replays with its own cache sizes",
}
"""Benchmarks without an expert budget to set, and why: `--device-cache` is refused there, saying so."""


FILE_OUT = {"e2e", "quant", "llamacpp"}
"""Benchmarks whose --out is a file of JSON lines; the others' is a folder."""


class MissingBenchmark(Exception):
    """The module of a benchmark is not part of this installation."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=[*BENCHMARKS, "all"], metavar="NAME",
                        help=f"one of {', '.join(BENCHMARKS)}, or all")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments of the benchmark (see moeinf bench NAME --help)")


def load(name: str) -> ModuleType:
    """The module implementing benchmark `name`, imported only now so `moeinf --help` stays fast."""
    module_name = f"moeinf.bench.{MODULES.get(name, name)}"
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise MissingBenchmark(f"benchmark {name!r} is not available: {module_name} is missing from this "
                               f"installation") from None


def bench_parser(name: str, module: ModuleType) -> argparse.ArgumentParser:
    """The parser of benchmark `name`: its module's flags, with the shared --device-cache."""
    parser = options.Parser(prog=f"moeinf bench {name}", description=module.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    add_device_cache(name, parser)
    for action in parser._actions:  # numpy's and torch's generators take no negative seed
        if "--seed" in action.option_strings and action.type is int:
            action.type = options.non_negative_int
        if "--out" in action.option_strings:  # a file for a folder or the reverse: now, not at the end
            action.type = options.output_file if name in FILE_OUT else options.output_dir
    return parser


def add_device_cache(name: str, parser: argparse.ArgumentParser) -> None:
    """--device-cache on benchmark `name`'s parser (`DEVICE_CACHE`), its module's spelling deprecated; or,
    where it has no expert budget, a --device-cache that refuses, saying why (`NO_DEVICE_CACHE`)."""
    if name not in DEVICE_CACHE:
        why = NO_DEVICE_CACHE.get(name, "it has no expert budget to set")

        def refuse(text: str) -> str:
            raise argparse.ArgumentTypeError(f"does not apply to bench {name}: {why}")

        parser.add_argument("--device-cache", type=refuse, default=None, metavar="SIZE",
                            help=f"not used: {why}")
        return
    flag, kind = DEVICE_CACHE[name]
    old = parser._option_string_actions[flag]
    default = old.default
    if flag != "--device-cache":
        for option in old.option_strings:
            del parser._option_string_actions[option]
        old.container._remove_action(old)
        parser.add_argument(flag, dest=old.dest, type=old.type, action=options.Deprecated,
                            replacement="--device-cache (the same budget"
                                        f"{', as a percentage' if kind == 'share' else ''})")
    elif old.container is not None:
        old.container._remove_action(old)
        del parser._option_string_actions[flag]
    shown = f"{100 * default:g}%" if kind == "share" and isinstance(default, float) else str(default)
    shown = shown.replace("%", "%%")
    several = {"sizes": "; comma-separated sizes run each",
               "sizes-or-min": "; comma-separated sizes run each; min: the smallest it allows"}.get(kind, "")
    parser.add_argument("--device-cache", dest=old.dest, type=CACHE_TYPES[kind], default=default,
                        metavar="SIZES" if kind.startswith("sizes") else "SIZE",
                        help="budget of the compute tier for experts, as in every command: a size ('4GiB') "
                             f"or a share of the model's expert bytes ('25%%'){several} (default {shown})")


def _sizes(text: str, keywords: tuple[str, ...] = ()) -> str:
    """Comma-separated sizes, each checked (`keywords` pass as they are); '' where a benchmark reads it as
    "skip these runs"."""
    parts = (p.strip() for p in text.split(","))
    return ",".join(p if p in keywords else options.size(p) for p in parts if p)


def _share(text: str) -> float:
    value = options.size(text)
    if not value.endswith("%"):
        raise argparse.ArgumentTypeError(f"{text!r}: this benchmark takes a share of the expert bytes, e.g. "
                                         "'25%'")
    return float(value[:-1]) / 100


CACHE_TYPES = {"size": options.size, "sizes": _sizes, "share": _share,
               "sizes-or-min": functools.partial(_sizes, keywords=("min",))}


def run_one(name: str, argv: list[str]) -> int:
    module = load(name)
    return int(module.run(bench_parser(name, module).parse_args(argv)) or 0)


def run(args: argparse.Namespace) -> int:
    if args.name == "all":
        from moeinf.bench.report import add_suite_arguments, run_suite

        parser = argparse.ArgumentParser(prog="moeinf bench all", description=run_suite.__doc__)
        add_suite_arguments(parser)
        parser._option_string_actions["--out"].type = options.output_dir
        return run_suite(parser.parse_args(args.args))
    try:
        return run_one(args.name, args.args)
    except MissingBenchmark as exc:
        print(f"moeinf bench: error: {exc}", file=sys.stderr)
        return 2
