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
from collections.abc import Callable
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
    """An ArgumentParser whose mistakes are one line on stderr (exit 2), not the usage block. A flag it
    does not know is reported by the subcommand's parser (its name kept), with the closest flags."""

    commands: dict[str, argparse.ArgumentParser]

    def error(self, message: str) -> Any:  # argparse's contract: never returns
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        nested = any(a.nargs in (argparse.REMAINDER, argparse.PARSER) for a in self._actions)
        if not hasattr(self, "commands") and not nested and args is not None:  # a command's own flags
            unknown = [a for a in unknown_flags(self, list(args))]
            if unknown:
                self.error(unknown_arguments(self, unknown))
        return super().parse_known_args(args, namespace)

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            owner = getattr(self, "commands", {}).get(getattr(parsed, "command", None) or "", self)
            owner.error(unknown_arguments(owner, extras))
        return parsed


def unknown_flags(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """The flags among `args` that `parser` has no option for (exact, or an unambiguous prefix as argparse
    accepts), so they are reported before a missing required argument hides them."""
    import re

    known = list(parser._option_string_actions)
    out = []
    for arg in args:
        if arg == "--":
            break
        if not arg.startswith("-") or arg == "-" or re.fullmatch(r"-\d+(\.\d*)?|-\.\d+", arg):
            continue
        name = arg.split("=", 1)[0]
        if name in known or (name.startswith("--") and any(k.startswith(name) for k in known)):
            continue
        out.append(arg)
    return out


def unknown_arguments(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """argparse's message for arguments no flag takes, with the closest flags of `parser`."""
    import difflib

    shown = [action for action in parser._actions if action.help != argparse.SUPPRESS]
    known = [s for action in shown for s in action.option_strings]
    hints = []
    for extra in extras:
        if extra.startswith("-"):
            close = difflib.get_close_matches(extra.split("=", 1)[0], known, n=2, cutoff=0.6)
            if close:
                hints.append(f"{extra.split('=', 1)[0]}: did you mean {' or '.join(close)}?")
    message = f"unrecognized arguments: {' '.join(extras)}"
    return f"{message} ({'; '.join(hints)})" if hints else message


class Deprecated(argparse.Action):
    """An old spelling of a flag: it still works, says so on stderr, and is hidden from --help.
    `replacement` is what to write instead."""

    def __init__(self, option_strings: list[str], dest: str, replacement: str, nargs: Any = None,
                 const: Any = None, **kwargs: Any) -> None:
        kwargs.setdefault("default", argparse.SUPPRESS)
        kwargs["help"] = argparse.SUPPRESS
        super().__init__(option_strings, dest, nargs=nargs, const=const, **kwargs)
        self.replacement = replacement

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"{parser.prog}: warning: {option_string} is deprecated; write {self.replacement}",
              file=sys.stderr)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


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


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
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


class ModelArg(str):
    """A model argument as the user wrote it (a str), and once resolved, the local checkpoint directory
    with its `moeinf.hub.ModelRef` (`ref`: the store and EAMC that go with it)."""

    ref: Any = None


def model_dir(text: str) -> str:
    """A model argument: a checkpoint directory (checked now), a zoo name or a HuggingFace id (resolved by
    `resolve_model_args` once every flag is parsed: the hub needs --revision)."""
    from moeinf.hub import ModelRefError, checkpoint_dir, kind_of

    try:
        if kind_of(text) == "dir":
            checkpoint_dir(Path(text).expanduser(), text)
    except ModelRefError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return ModelArg(text)


def resolve_model(model: str | Path, *, revision: str | None = None, progress: bool = True) -> ModelArg:
    """`model` resolved to a local checkpoint directory carrying its ModelRef (idempotent)."""
    from moeinf.hub import resolve_model as resolve

    if getattr(model, "ref", None) is not None:
        return model  # type: ignore[return-value]
    return model_arg(resolve(model, revision=revision, progress=progress))


def model_arg(ref: Any) -> ModelArg:
    """The ModelArg of a resolved `moeinf.hub.ModelRef`."""
    out = ModelArg(str(ref.path))
    out.ref = ref
    return out


def resolve_model_args(args: argparse.Namespace) -> None:
    """Resolve the parsed model argument in place (cli.main calls this before a command runs), and apply
    --threads, the one place torch's thread count is changed: only when the user asks."""
    if getattr(args, "model_dir", None) is not None:
        progress = not getattr(args, "json", False)
        args.model_dir = resolve_model(args.model_dir, revision=getattr(args, "revision", None),
                                       progress=progress)
    threads = getattr(args, "threads", None)
    if threads is not None:
        import os

        import torch

        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if threads > cpus:
            log.warning("--threads %d is more than the %d CPUs this process may use: the threads take turns "
                        "on them, which slows every step; --threads %d or fewer", threads, cpus, cpus)
        torch.set_num_threads(threads)


def existing_file(text: str) -> str:
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a file")
    return str(path)


def existing_path(text: str) -> str:
    """A file or a directory that exists."""
    if not Path(text).expanduser().exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    return str(Path(text).expanduser())


def model_name(text: str) -> str:
    """A model id that clients send: any text but an empty or blank one (no request could name it)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; give the id clients send as 'model' (or leave the flag "
                                         "out: MODEL as named)")
    return text


def stop_text(text: str) -> str:
    """A stop string: any text but the empty one (blank lines are a usual stop)."""
    if not text:
        raise argparse.ArgumentTypeError("is empty; give the text that ends an answer")
    return text


# --- flag groups ------------------------------------------------------------------------------------------
MODEL_HELP = ("a checkpoint directory (config.json and safetensors weights), a zoo model (demo, full) or a "
              "HuggingFace id (org/name, read from the hub cache, downloaded when absent)")


def add_model_argument(parser: argparse.ArgumentParser, *, optional: bool = False) -> None:
    """MODEL (dest `model_dir`) and --revision. `optional`: the positional may be left out (a command
    that also takes the deprecated --model spelling)."""
    if optional:
        parser.add_argument("model_dir", metavar="MODEL", type=model_dir, nargs="?", default=None,
                            help=MODEL_HELP)
    else:
        parser.add_argument("model_dir", metavar="MODEL", type=model_dir, help=MODEL_HELP)
    parser.add_argument("--revision", default=None, metavar="REV",
                        help="branch, tag or commit of a HuggingFace id (default: main)")


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N",
                        help="torch CPU threads (default: torch's own choice, left unchanged)")


DEFAULT_MAX_NEW_TOKENS = 128
"""--max-new-tokens of every command that generates (a trace or a replay sets lengths of its own)."""


def add_generation_arguments(parser: argparse.ArgumentParser, *, temperature: float,
                             max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, stop: bool = True) -> None:
    """--max-new-tokens, --temperature, --top-p, --top-k, --repetition-penalty, --stop, --seed, --threads
    (llama.cpp's names and meanings). `stop`: offer --stop (a command whose lengths are fixed does not)."""
    group = parser.add_argument_group("generation")
    group.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens, metavar="N",
                       help="longest answer in tokens (checked against the model's context length)")
    group.add_argument("--max-tokens", dest="max_new_tokens", type=positive_int, action=Deprecated,
                       replacement="--max-new-tokens")
    group.add_argument("--temperature", type=non_negative_float, default=temperature, metavar="T",
                       help="sampling temperature; 0 = greedy (the most likely token every step)")
    group.add_argument("--top-p", type=probability, default=0.95, metavar="P",
                       help="nucleus sampling: sample among the most likely tokens holding this probability")
    group.add_argument("--top-k", type=non_negative_int, default=0, metavar="K",
                       help="sample among the K most likely tokens only; 0 = no limit")
    group.add_argument("--repetition-penalty", type=positive_float, default=1.0, metavar="R",
                       help="divide the positive logits (multiply the negative) of tokens already in the "
                            "prompt or answer by R; 1 = off, 1.1 a usual value")
    if stop:
        group.add_argument("--stop", action="append", default=[], metavar="TEXT", type=stop_text,
                           help="end the answer before TEXT (repeatable)")
    group.add_argument("--seed", type=int, default=0, metavar="N",
                       help="seed of sampling (same seed, same answer)")
    group.add_argument("--threads", type=positive_int, default=None, metavar="N",
                       help="torch CPU threads (default: torch's own choice, left unchanged)")


def hf_sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The transformers `generate` keywords of the generation flags (explicit, so the checkpoint's
    generation_config, e.g. its top_k of 50, does not change their meaning)."""
    out: dict[str, Any] = {"repetition_penalty": args.repetition_penalty}
    if args.temperature == 0:
        return {**out, "do_sample": False, "top_k": None, "top_p": None, "temperature": None}
    return {**out, "do_sample": True, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k}


def add_offload_arguments(parser: argparse.ArgumentParser, *, device_cache: str | None = None,
                          no_offload: bool = False, several_policies: bool = False) -> None:
    """The OffloadConfig flags. `device_cache`: this command's default (None: `DEFAULT_DEVICE_CACHE` within
    the memory available); `no_offload`: also offer --no-offload (run the unmodified transformers model,
    for comparison); `several_policies`: --prefetch and --eviction take several values, each combination
    run (a list in args)."""
    group = parser.add_argument_group("offloading (fields of OffloadConfig)")
    cache_help = ("budget of the compute tier for experts (GPU memory, or DRAM on a CPU machine): '4GiB', "
                  "'512MB' or a share of the model's expert bytes such as '25%%'")
    if device_cache is None:
        cache_help += "; default: chosen from the memory available now, and printed"
    group.add_argument("--device-cache", type=size, default=device_cache, metavar="SIZE", help=cache_help)
    group.add_argument("--cache", dest="device_cache", type=size, action=Deprecated,
                       replacement="--device-cache")
    group.add_argument("--host-cache", type=size, default="0", metavar="SIZE",
                       help="budget of the host DRAM staging tier between SSD and a GPU (0 on a CPU machine)")
    group.add_argument("--offload-dir", default=None, metavar="DIR",
                       help="expert store directory, packed on first use (default: MODEL_DIR.moeinf)")
    group.add_argument("--eamc", type=existing_file, default=None, metavar="FILE",
                       help="EAMC file from `moeinf trace` predicting expert use (default: learn online)")
    several = {"nargs": "+"} if several_policies else {}
    each = " (several: each combination with --eviction is run)" if several_policies else ""
    group.add_argument("--prefetch", choices=PREFETCH_POLICIES, metavar="POLICY",
                       default=[OffloadConfig.prefetch] if several_policies else OffloadConfig.prefetch,
                       help=f"prefetch policy: {', '.join(PREFETCH_POLICIES)}{each}", **several)
    group.add_argument("--eviction", choices=EVICTION_POLICIES, metavar="POLICY",
                       default=[OffloadConfig.eviction] if several_policies else OffloadConfig.eviction,
                       help=f"eviction policy of the expert cache: {', '.join(EVICTION_POLICIES)}"
                            f"{each.replace('--eviction', '--prefetch')}", **several)
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


NO_OFFLOAD_IGNORES = (("device_cache", "--device-cache"), ("host_cache", "--host-cache"),
                      ("offload_dir", "--offload-dir"), ("eamc", "--eamc"), ("prefetch", "--prefetch"),
                      ("eviction", "--eviction"), ("device", "--device"), ("quant", "--quant"),
                      ("quant_dense", "--quant-dense"), ("io_threads", "--io-threads"))
"""The offloading flags (dest, flag) that --no-offload leaves unused: it loads the whole model with
transformers on the CPU (in --dtype for generate; chat, serve and replay load it in float32,
`moeinf.serve.loader`, so --dtype is unused there too)."""


def check_no_offload(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """With --no-offload, an offloading flag set to other than its default is a `UsageError` naming it,
    rather than being dropped in silence."""
    if not getattr(args, "no_offload", False):
        return
    ignored, where = NO_OFFLOAD_IGNORES, "on the CPU"
    if args.command in ("chat", "serve", "replay"):
        ignored, where = (*ignored, ("dtype", "--dtype")), "on the CPU in float32"
    given = [flag for dest, flag in ignored
             if hasattr(args, dest) and getattr(args, dest) != _default(parser, dest)]
    if given:
        verb = "has" if len(given) == 1 else "have"
        raise UsageError(f"{', '.join(given)} {verb} no effect with --no-offload, which loads the whole "
                         f"model with transformers {where}; drop one or the other")


def _default(parser: argparse.ArgumentParser, dest: str) -> Any:
    """`dest`'s default (get_default skips a None default and finds a deprecated alias's SUPPRESS)."""
    value = parser.get_default(dest)
    return None if value == argparse.SUPPRESS else value


def offload_config(args: argparse.Namespace, model: str | Path | None = None,
                   **overrides: Any) -> OffloadConfig:
    """The OffloadConfig of the flags, with the defaults of the model (`moeinf.api.with_model_defaults`:
    the store of zoo and hub models under $MOEINF_CACHE, a zoo model's shipped EAMC). Without
    --device-cache the budget is `DEFAULT_DEVICE_CACHE` of the experts, as the demo offloads, within
    what memory allows (`auto_device_cache`), and printed on stderr."""
    device_cache = args.device_cache
    if device_cache is None:
        if model is None:
            raise ValueError("offload_config: give the model directory to size the default device cache")
        budget, why = auto_device_cache(model)
        print(f"device cache: {budget if isinstance(budget, str) else format_bytes(budget)} ({why}; "
              "--device-cache to choose)", file=sys.stderr)
        device_cache = budget
    values: dict[str, Any] = dict(
        device_cache=device_cache, host_cache=args.host_cache, offload_dir=args.offload_dir, eamc=args.eamc,
        prefetch=args.prefetch, eviction=args.eviction, device=args.device, dtype=args.dtype,
        io_threads=args.io_threads, quant=args.quant, quant_dense=args.quant_dense,
    )
    values.update(overrides)
    if values.get("eamc"):
        check_eamc(values["eamc"])
    config = OffloadConfig(**values)
    ref = getattr(model, "ref", None)
    if ref is not None:
        from moeinf.api import with_model_defaults

        config = with_model_defaults(config, ref)
    return config


def check_eamc(path: str) -> None:
    """--eamc names a file `moeinf trace` wrote; else a one-line error naming the file."""
    from moeinf.trace.eamc import EAMC

    try:
        EAMC.load(path)
    except Exception as exc:  # safetensors raises its own SafetensorError for a file that is not one
        if not isinstance(exc, (ValueError, OSError)) and type(exc).__name__ != "SafetensorError":
            raise
        reason = " ".join(str(exc).split())
        raise UsageError(f"--eamc {path} is not an EAMC file written by `moeinf trace` ({reason}); give one, "
                         "or leave --eamc out to learn expert use online") from None


def flag_names(message: str, parser: argparse.ArgumentParser) -> str:
    """A config error's field names (device_cache) written as the flags that set them (--device-cache)."""
    import dataclasses
    import re

    fields = {f.name for f in dataclasses.fields(OffloadConfig)}
    for action in parser._actions:
        flags = [s for s in action.option_strings if s.startswith("--")]
        if flags and action.help != argparse.SUPPRESS and action.dest in fields:
            # a one-word field (device, eviction) is a flag only where it names a setting ("device:",
            # "device=..."): elsewhere it is an English word ("no CUDA device")
            tail = r"(=?)" if "_" in action.dest else r"(?=[:=])(=?)"
            message = re.sub(rf"(?<![-\w.]){action.dest}\b{tail}",
                             lambda m, flag=flags[0]: flag + (" " if m.group(1) else ""), message)
    return message


# --- machine-fitted defaults ------------------------------------------------------------------------------
DEFAULT_DEVICE_CACHE = "25%"
"""Without --device-cache every command keeps this share of the experts in the compute tier, as
`moeinf demo` does: the model runs offloaded (a cache smaller than its experts) by default."""


def checkpoint_bytes(model: str | Path) -> int:
    """Bytes of the checkpoint's safetensors files: an upper bound on its expert bytes."""
    return sum(p.stat().st_size for p in Path(model).glob("*.safetensors"))


def auto_device_cache(model: str | Path) -> tuple[int | str, str]:
    """(budget, why): `DEFAULT_DEVICE_CACHE` of the experts, unless that could exceed half the memory
    available now (psutil), then that half in bytes: choosing it cannot make the machine swap."""
    import psutil

    available = psutil.virtual_memory().available
    half = int(AUTO_CACHE_SHARE_OF_AVAILABLE * available)
    whole = checkpoint_bytes(model)
    share = float(DEFAULT_DEVICE_CACHE.rstrip("%")) / 100
    if share * whole <= half:
        why = (f"the default: {DEFAULT_DEVICE_CACHE} of the experts stay in memory and the rest are read "
               "from the store when needed, as `moeinf demo` does")
        return DEFAULT_DEVICE_CACHE, why
    return half, (f"{AUTO_CACHE_SHARE_OF_AVAILABLE:.0%} of the {format_bytes(available)} of memory "
                  f"available, less than the default {DEFAULT_DEVICE_CACHE} of a {format_bytes(whole)} "
                  "checkpoint")


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


def output_dir(text: str) -> str:
    """An argparse type: a results directory (made by the command) that is not an existing file."""
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; give a directory for the results")
    return text


def output_file(text: str) -> str:
    """An argparse type: a results file (appended to or made by the command) that is not a directory."""
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file's path, e.g. "
                                         f"{Path(text) / 'results.jsonl'}")
    return text


def check_output_file(flag: str, path: str | Path, *, example: str,
                      ours: Callable[[Path], bool] | None = None, what: str = "") -> None:
    """Refuse, before any work, an output file `path` (given by `flag`) that would fail or destroy
    something when written at the end: a directory, a place that cannot be written, or (with `ours`) an
    existing file that is not `what`, this command's own output. Creates the missing parent folders."""
    import tempfile

    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file's path, e.g. {path / example}")
    if ours is not None and path.is_file() and path.stat().st_size > 0 and not ours(path):
        raise UsageError(f"{flag} {path} exists and is not {what}; give another path (it is not overwritten)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".probe"):
            pass
    except OSError as exc:
        raise UsageError(f"{flag} {path} cannot be written ({exc.strerror or exc}); give a path on a "
                         "writable disk") from None


def check_context(model: str | Path, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse, before any work, a prompt plus answer longer than the model's context."""
    limit = context_length(model)
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        room = limit - prompt_tokens
        fix = f"use --max-new-tokens {room} or less" if room > 0 else "shorten the prompt"
        raise UsageError(f"a prompt of {prompt_tokens} tokens plus --max-new-tokens {max_new_tokens} exceeds "
                         f"the model's context of {limit} tokens; {fix}")


def ensure_store(model: str | Path, config: OffloadConfig, *, progress: bool) -> None:
    """Pack the expert store now, with progress, when this is the model's first use (`moeinf.api.pack_store`:
    a place that cannot be written is one line naming MOEINF_CACHE or --offload-dir)."""
    from moeinf.api import pack_store

    pack_store(Path(model), config, progress=progress)


def speed_line(stats: dict[str, Any]) -> str:
    """Tokens/s of prefill and decode (MoE.stats(): `moeinf.api.Usage`), as generate, chat, demo and batch
    print them."""
    get = stats.get
    return (f"prefill {get('prefill_tokens_per_s', 0.0):.1f} tokens/s ({get('prompt_tokens', 0)} prompt "
            f"tokens), decode {get('decode_tokens_per_s', 0.0):.1f} tokens/s ({get('decode_tokens', 0)} "
            f"tokens after the first); {get('tokens', 0)} tokens generated")


def stats_line(stats: dict[str, Any]) -> str:
    """The runtime's counters (MoE.stats()) in one line, as generate, demo and chat print them."""
    return (f"{stats['tokens']} tokens; expert accesses {stats['accesses']}, hits {stats['hits']}, "
            f"misses {stats['misses']} (hit rate {stats['hit_rate']:.2f}), evictions {stats['evictions']}, "
            f"prefetches {stats['prefetches']} (precision {stats['prefetch_precision']:.2f}, "
            f"recall {stats['prefetch_recall']:.2f}), read {stats['bytes_read'] / 2**20:.1f} MiB, "
            f"stalled {stats['stall_s']:.2f} s")
