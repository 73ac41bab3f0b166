"""The flags every command shares: one name, one meaning, one validation, defaults shown in `--help`.

A command calls the `add_*` helpers on its parser and turns the parsed flags into an `OffloadConfig` with
`offload_config(args, model_dir)`. Values are checked by argparse types here, so a mistake is one line
naming the flag before any model is loaded:

    add_model_argument(parser)                       # MODEL_DIR, checked to be a checkpoint directory
    add_generation_arguments(parser, max_new_tokens=32, temperature=0.0)
    add_offload_arguments(parser)                    # --device-cache, --prefetch, --eviction, ...
    config = offload_config(args, args.model_dir)    # device_cache chosen from free memory when unset

Sizes are written with a unit ('4GiB', '512MB') or as a share of the model's expert bytes ('25%'); a bare
number is refused (is '1' one byte or one GiB?), except 0.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import Any

from moeinf.config import (
    DEVICES,
    EVICTION_POLICIES,
    PREFETCH_POLICIES,
    QUANT_DENSE,
    QUANT_SETTINGS,
    ConfigError,
    OffloadConfig,
    parse_size,
)

log = logging.getLogger(__name__)

# Exit codes of every command (listed in `moeinf --help` and the README).
EXIT_OK = 0
EXIT_FAILURE = 1
"""The work failed or found problems: a corrupt store, a failed check, failed requests."""
EXIT_USAGE = 2
"""The command line is wrong: a bad flag value, a path that is not what the command needs."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (128 + SIGINT, the shell convention)."""

DTYPES = ("auto", "float32", "bfloat16", "float16")
AUTO_CACHE_SHARE_OF_AVAILABLE = 0.5
"""Without --device-cache the experts get at most this share of the memory available now: the dense
weights, activations, the KV cache and the page cache of the expert store need the rest."""


class UsageError(Exception):
    """The user's input is wrong; the message says what and what to do instead (exit code 2)."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default and keeps the examples of a command's docstring as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:  # unset flags and switches: nothing to show
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose mistakes are one line on stderr (exit 2), not the usage block."""

    def error(self, message: str) -> Any:  # argparse's contract: never returns
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


# --- argparse types ---------------------------------------------------------------------------------------
def size(text: str) -> str:
    """A size flag: '4GiB', '512MB', '25%' or 0; returned as written for OffloadConfig."""
    stripped = text.strip()
    try:
        number = float(stripped)
    except ValueError:
        number = None
    if number is not None and number != 0:
        share = f"{100 * number:g}%" if number < 1 else f"{stripped}%"
        hint = f"'{number:g}GiB' or '{share}'"
        raise argparse.ArgumentTypeError(
            f"{text!r} has no unit; write a size such as {hint} (a share of the model's expert bytes)")
    try:
        parse_size(stripped, field="size")
    except ConfigError:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a size; write e.g. '4GiB', '512MB' or '25%' (at most 100%)") from None
    return stripped


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def share(text: str) -> float:
    """A share in [0, 1)."""
    value = non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1), got {text}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def probability(text: str) -> float:
    value = non_negative_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {text}")
    return value


def model_dir(text: str) -> str:
    """A HuggingFace checkpoint directory (what `save_pretrained` writes: config.json and weights)."""
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist; give a HuggingFace checkpoint directory")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; give the checkpoint's directory "
                                         "(with config.json)")
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(
            f"{text} has no config.json, so it is not a HuggingFace checkpoint directory; give the directory "
            "that `save_pretrained` wrote (a model hub id is not downloaded)")
    return str(path)


def existing_file(text: str) -> str:
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a file")
    return str(path)


def non_empty_text(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; give some text")
    return text


# --- flag groups ------------------------------------------------------------------------------------------
def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", type=model_dir,
                        help="HuggingFace checkpoint directory (config.json and safetensors weights)")


def add_generation_arguments(parser: argparse.ArgumentParser, *, max_new_tokens: int,
                             temperature: float) -> None:
    """--max-new-tokens, --temperature, --top-p, --seed."""
    group = parser.add_argument_group("generation")
    group.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens, metavar="N",
                       help="longest answer in tokens (checked against the model's context length)")
    # Older spellings, kept working but not advertised.
    for alias in ("--max-tokens",):
        group.add_argument(alias, dest="max_new_tokens", type=positive_int, default=argparse.SUPPRESS,
                           help=argparse.SUPPRESS)
    group.add_argument("--temperature", type=non_negative_float, default=temperature, metavar="T",
                       help="sampling temperature; 0 = greedy (the most likely token every step)")
    group.add_argument("--top-p", type=probability, default=0.95, metavar="P",
                       help="nucleus sampling: sample among the most likely tokens holding this probability")
    group.add_argument("--seed", type=int, default=0, metavar="N",
                       help="seed of sampling (same seed, same answer)")


def add_offload_arguments(parser: argparse.ArgumentParser, *, device_cache: str | None = None,
                          no_offload: bool = False) -> None:
    """The OffloadConfig flags. `device_cache`: this command's default (None: chosen from free memory);
    `no_offload`: also offer --no-offload (run the unmodified transformers model, for comparison)."""
    group = parser.add_argument_group("offloading (fields of OffloadConfig)")
    cache_help = ("budget of the compute tier for experts (GPU memory, or DRAM on a CPU machine): '4GiB', "
                  "'512MB' or a share of the model's expert bytes such as '25%%'")
    if device_cache is None:
        cache_help += "; default: chosen from the memory available now, and printed"
    group.add_argument("--device-cache", type=size, default=device_cache, metavar="SIZE", help=cache_help)
    group.add_argument("--cache", dest="device_cache", type=size, default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)
    group.add_argument("--host-cache", type=size, default="0", metavar="SIZE",
                       help="budget of the host DRAM staging tier between SSD and a GPU (0 on a CPU machine)")
    group.add_argument("--offload-dir", default=None, metavar="DIR",
                       help="expert store directory, packed on first use (default: MODEL_DIR.moeinf)")
    group.add_argument("--eamc", type=existing_file, default=None, metavar="FILE",
                       help="EAMC file from `moeinf trace` predicting expert use (default: learn online)")
    group.add_argument("--prefetch", choices=PREFETCH_POLICIES, default=OffloadConfig.prefetch,
                       help="prefetch policy")
    group.add_argument("--eviction", choices=EVICTION_POLICIES, default=OffloadConfig.eviction,
                       help="eviction policy of the expert cache")
    group.add_argument("--device", choices=DEVICES, default=OffloadConfig.device, help="compute device")
    group.add_argument("--dtype", choices=DTYPES, default=OffloadConfig.dtype,
                       help="compute dtype (auto: the checkpoint's)")
    group.add_argument("--quant", choices=QUANT_SETTINGS, default=OffloadConfig.quant,
                       help="expert weights: none (exact), int8 or int4 (a quantised store, default "
                            "MODEL_DIR.moeinf-int4...); auto: whatever the store at --offload-dir holds")
    group.add_argument("--quant-dense", choices=QUANT_DENSE, default=OffloadConfig.quant_dense,
                       help="with a quantised store, which dense weights also compute quantised with the "
                            "store's scheme: none, the shared experts, or the shared experts and the LM "
                            "head (default %(default)s)")
    group.add_argument("--io-threads", type=positive_int, default=OffloadConfig.io_threads, metavar="N",
                       help="threads reading the expert store")
    if no_offload:
        group.add_argument("--no-offload", action="store_true",
                           help="load the whole model with transformers instead of offloading its experts")


def offload_config(args: argparse.Namespace, model: str | Path | None = None,
                   **overrides: Any) -> OffloadConfig:
    """The OffloadConfig of the flags. Without --device-cache the budget comes from `auto_device_cache`
    for `model` and is printed on stderr."""
    device_cache = args.device_cache
    if device_cache is None:
        if model is None:
            raise ValueError("offload_config: give the model directory to size the default device cache")
        budget, why = auto_device_cache(model)
        print(f"device cache: {format_bytes(budget)} ({why}; --device-cache to choose)", file=sys.stderr)
        device_cache = budget
    values: dict[str, Any] = dict(
        device_cache=device_cache, host_cache=args.host_cache, offload_dir=args.offload_dir, eamc=args.eamc,
        prefetch=args.prefetch, eviction=args.eviction, device=args.device, dtype=args.dtype,
        io_threads=args.io_threads, quant=args.quant, quant_dense=args.quant_dense,
    )
    values.update(overrides)
    return OffloadConfig(**values)


# --- machine-fitted defaults ------------------------------------------------------------------------------
def checkpoint_bytes(model: str | Path) -> int:
    """Bytes of the checkpoint's safetensors files: an upper bound on its expert bytes."""
    return sum(p.stat().st_size for p in Path(model).glob("*.safetensors"))


def auto_device_cache(model: str | Path) -> tuple[int, str]:
    """(bytes, why): all the model's experts when they fit in half the memory available now (psutil),
    else that half; never more than is free, so choosing it cannot make the machine swap."""
    import psutil

    available = psutil.virtual_memory().available
    share = int(AUTO_CACHE_SHARE_OF_AVAILABLE * available)
    whole = checkpoint_bytes(model)
    if whole and whole <= share:
        return whole, f"the whole checkpoint; {format_bytes(available)} of memory available"
    return share, (f"{AUTO_CACHE_SHARE_OF_AVAILABLE:.0%} of the {format_bytes(available)} of memory "
                   f"available; the checkpoint has {format_bytes(whole)}")


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def context_length(model: str | Path) -> int | None:
    """The model's maximum positions from its config.json (None when it has no such limit)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model))
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_context(model: str | Path, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse, before any work, a prompt plus answer longer than the model's context."""
    limit = context_length(model)
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        room = limit - prompt_tokens
        fix = f"use --max-new-tokens {room} or less" if room > 0 else "shorten the prompt"
        raise UsageError(f"a prompt of {prompt_tokens} tokens plus --max-new-tokens {max_new_tokens} exceeds "
                         f"the model's context of {limit} tokens; {fix}")


def ensure_store(model: str | Path, config: OffloadConfig, *, progress: bool) -> None:
    """Pack the expert store now, with a progress bar, when this is the model's first use (the runtime
    would otherwise pack it silently)."""
    from moeinf.builder import store_plan
    from moeinf.store import pack
    from moeinf.store.index import INDEX_NAME

    store, quant = store_plan(Path(model), config)
    if (store / INDEX_NAME).is_file():
        return
    print(f"packing the expert store {store} (first use of this model)", file=sys.stderr)
    pack(model, store, quant=quant, progress=progress)


def stats_line(stats: dict[str, Any]) -> str:
    """The runtime's counters (MoE.stats()) in one line, as generate, demo and chat print them."""
    return (f"{stats['tokens']} tokens; expert accesses {stats['accesses']}, hits {stats['hits']}, "
            f"misses {stats['misses']} (hit rate {stats['hit_rate']:.2f}), evictions {stats['evictions']}, "
            f"prefetches {stats['prefetches']} (precision {stats['prefetch_precision']:.2f}, "
            f"recall {stats['prefetch_recall']:.2f}), read {stats['bytes_read'] / 2**20:.1f} MiB, "
            f"stalled {stats['stall_s']:.2f} s")
