"""Benchmarks. `moeinf bench NAME [ARGS...]` runs the benchmark `moeinf/bench/NAME.py`; `moeinf bench NAME
--help` lists its arguments. `moeinf bench all [ARGS...]` runs every available benchmark with the same
own arguments (quick or full, `--quick`) and writes DIR/report.md (`moeinf bench all --help`).

  io        expert I/O engine against raw O_DIRECT reads of a store (bandwidth, demand latency, preemption)
  eamc      EAMC matching and prediction accuracy
  cache     expert cache hit rates of the eviction policies
  prefetch  prefetch policies: coverage and latency
  e2e       end-to-end generation latency and throughput
  accelerate  per-token latency of HuggingFace + accelerate disk offload (the baseline to e2e)
  quant     quantised expert stores: kernel choice (one expert's forward) and quality (perplexity, greedy)
  llamacpp  llama.cpp beside moeinf on the same checkpoint (needs pip install 'moeinf[llamacpp]')
  exact     bit-exactness against HF: every family x dtype x cache x prefetch/eviction pair
  overhead  decode ms/token with every expert resident, against HF on the same model
  batch     decode step cost of a batch of rows against one row, at 25% cache
  ep        expert parallelism: ms/token at 1 and 2 ranks, bytes exchanged, placement balance
  scale     a model bigger than the machine: every system under the same cgroup memory cap
  soak      bursts of concurrent requests with bad ones mixed in: server RSS per burst, 200s and 4xx
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

# name -> one-line help; moeinf.bench.<name> implements it with add_arguments(parser) and run(args) -> int.
BENCHMARKS: dict[str, str] = {
    "io": "expert I/O engine against raw O_DIRECT reads of a store",
    "eamc": "EAMC matching and prediction accuracy",
    "cache": "expert cache hit rates of the eviction policies",
    "prefetch": "prefetch policies: coverage and latency",
    "e2e": "end-to-end generation latency and throughput",
    "accelerate": "per-token latency of HuggingFace + accelerate disk offload",
    "quant": "quantised expert stores: kernel choice and quality against the exact model",
    "llamacpp": "llama.cpp (bf16, Q8_0, Q4_0) beside moeinf on the same checkpoint",
    "exact": "bit-exactness against HF: every family x dtype x cache x prefetch/eviction pair",
    "overhead": "decode ms/token with every expert resident, against HF on the same model",
    "batch": "decode step cost of a batch of rows against one row (does batching pay?)",
    "ep": "expert parallelism: ms/token at 1 and 2 ranks, bytes exchanged, placement balance",
    "scale": "a model bigger than the machine: every system under the same cgroup memory cap",
    "soak": "bursts of concurrent requests with bad ones mixed in: server RSS per burst, 200s and 4xx",
}
# benchmarks whose module name differs from the benchmark name
MODULES: dict[str, str] = {"accelerate": "accelerate_baseline"}


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


def run_one(name: str, argv: list[str]) -> int:
    module = load(name)
    parser = argparse.ArgumentParser(prog=f"moeinf bench {name}", description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(argv)) or 0)


def run(args: argparse.Namespace) -> int:
    if args.name == "all":
        from moeinf.bench.report import add_suite_arguments, run_suite

        parser = argparse.ArgumentParser(prog="moeinf bench all", description=run_suite.__doc__)
        add_suite_arguments(parser)
        return run_suite(parser.parse_args(args.args))
    try:
        return run_one(args.name, args.args)
    except MissingBenchmark as exc:
        print(f"moeinf bench: error: {exc}", file=sys.stderr)
        return 2
