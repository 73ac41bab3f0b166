"""The zoo models: small MoEs trained here (moeinf.zoo), and tools around them.

  moeinf zoo inflate SRC DST --hidden 2048 --moe-intermediate 768

`inflate` zero-pads a zoo checkpoint to big-model expert geometry (default: Qwen3-30B-A3B's, 9.4 MB per
expert in bf16) so that benchmarks read and multiply experts of real size while the routing, hidden
states and tokens stay the trained model's (see moeinf/zoo/inflate.py). SRC is a checkpoint directory or
a zoo variant name (full, quick, tiny: the cached model, trained first if absent).

  moeinf zoo synth deepseek-v2-lite DIR

`synth` writes a published MoE architecture at full size with random weights (deepseek-v2-lite,
qwen3-30b-a3b, mixtral-8x7b, olmoe-1b-7b) as a normal HF checkpoint, shard by shard in bounded memory;
rerun the same command to finish an interrupted one (see moeinf/zoo/synth.py). DIR needs the checkpoint's
size free (deepseek-v2-lite 31.4 GB, qwen3-30b-a3b 61.1 GB, mixtral-8x7b 93.4 GB, olmoe-1b-7b 13.8 GB); synth
checks before it writes, and `moeinf pack` needs about as much again for the store.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="zoo_command", metavar="ACTION", required=True)
    inflate = sub.add_parser("inflate", help="zero-pad a zoo model to big-model expert geometry",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    inflate.add_argument("src", metavar="SRC", help="zoo checkpoint directory, or a zoo variant name")
    inflate.add_argument("dst", metavar="DST", help="output directory (must be absent or empty)")
    inflate.add_argument("--hidden", type=int, default=2048, help="target hidden size (default 2048)")
    inflate.add_argument("--moe-intermediate", type=int, default=768,
                         help="target routed-expert intermediate size (default 768)")
    inflate.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                         help="dtype of the written weights (default bfloat16)")
    from moeinf.zoo.synth import ARCHITECTURES

    synth = sub.add_parser("synth", help="a published MoE architecture at full size with random weights",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    synth.add_argument("name", metavar="NAME", choices=sorted(ARCHITECTURES),
                       help=f"architecture: {', '.join(ARCHITECTURES)}")
    synth.add_argument("dst", metavar="DIR", help="output directory (absent, empty, or an interrupted synth)")
    synth.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    synth.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                       help="dtype of the written weights (default bfloat16)")
    synth.add_argument("--shard-size", type=float, default=2.0, metavar="GIB",
                       help="largest shard in GiB (default 2)")


def source_dir(src: str) -> Path:
    """SRC as a directory: itself when it exists, else the cached zoo model of that variant name."""
    path = Path(src)
    if path.is_dir():
        return path
    from moeinf.zoo import get_model
    from moeinf.zoo.train import RECIPES

    if src not in RECIPES:
        raise ValueError(f"{src} is neither a directory nor a zoo variant ({', '.join(sorted(RECIPES))})")
    return get_model(src)


def run(args: argparse.Namespace) -> int:
    if args.zoo_command == "synth":
        return run_synth(args)
    from moeinf.zoo.inflate import inflate

    try:
        src = source_dir(args.src)
        out = inflate(src, args.dst, hidden=args.hidden, moe_intermediate=args.moe_intermediate,
                      dtype=args.dtype, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except ValueError as exc:
        print(f"moeinf zoo inflate: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a directory that cannot be written, a full disk
        print(f"moeinf zoo inflate: error: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


def run_synth(args: argparse.Namespace) -> int:
    from moeinf.zoo.synth import SynthError, synth

    if args.shard_size <= 0:
        print("moeinf zoo synth: error: --shard-size must be positive", file=sys.stderr)
        return 2
    try:
        out = synth(args.name, args.dst, dtype=args.dtype, seed=args.seed,
                    shard_bytes=int(args.shard_size * 2**30))
    except (SynthError, OSError) as exc:
        print(f"moeinf zoo synth: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0
