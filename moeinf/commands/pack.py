"""Convert a model's checkpoint (config.json + *.safetensors) into an expert store: one 4 KiB-aligned blob
per expert in experts.bin, dense weights in dense.safetensors, an index. Re-packing the same model into
its store does nothing; another model's store is never overwritten.

  moeinf pack path/to/model                   # into path/to/model.moeinf, where every command looks
  moeinf pack demo                            # a zoo model: into $MOEINF_CACHE/stores
  moeinf pack org/name --offload-dir DIR --quant int4
  moeinf pack path/to/model --compress        # exact, a quarter fewer bytes to read (a slow drive)

The store goes where every other command looks for it by default (--offload-dir to choose), so a model
is packed once."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from moeinf.commands import options

if TYPE_CHECKING:
    from moeinf.store import StoreIndex


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_model_argument(parser)
    parser.add_argument("store_dir", metavar="STORE_DIR", nargs="?", default=None,
                        help="deprecated spelling of --offload-dir")
    parser.add_argument("--offload-dir", default=None, metavar="DIR",
                        help="where to write the store (default: where the other commands look: MODEL.moeinf "
                             "beside a checkpoint directory, $MOEINF_CACHE/stores for zoo and hub models)")
    parser.add_argument("--quant", choices=("int8", "int4"), default=None,
                        help="quantise the experts' weights (dense weights stay as they are): int8 with one "
                             "scale per output row, int4 with a scale and zero per group (default: exact)")
    parser.add_argument("--compress", action="store_true",
                        help="store exact bf16 experts losslessly coded (bf16-exp4: each weight's exponent "
                             "in 4 bits): 25%% fewer bytes on disk and to read per fetch, decoded bit for "
                             "bit by the I/O threads; worth it where fetches wait on the drive")
    parser.add_argument("--group-size", type=int, default=None,
                        help="int4: inputs per scale and zero, one of 32, 64, 128, 256 (default 32); int8: "
                             "only 0 (one scale per row)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    parser.add_argument("--no-progress", action="store_true",
                        help="do not show progress (a bar in a terminal, else a log line every 10 s)")


def run(args: argparse.Namespace) -> int:
    from moeinf.store import Store, StoreError, pack
    from moeinf.store.codec import CODEC
    from moeinf.store.quant import Quantization

    if args.compress and args.quant is not None:
        print("moeinf pack: error: --compress codes exact bf16 experts; it does not combine with --quant",
              file=sys.stderr)
        return 2
    if args.group_size is not None and args.quant is None:
        print("moeinf pack: error: --group-size needs --quant", file=sys.stderr)
        return 2
    try:
        quant = Quantization.of(args.quant, args.group_size) if args.quant else None
    except ValueError as exc:
        print(f"moeinf pack: error: --group-size: {exc}", file=sys.stderr)
        return 2
    if args.store_dir is not None:
        if args.offload_dir is not None:
            raise options.UsageError("give the store once: --offload-dir (STORE_DIR is its old spelling)")
        print("moeinf pack: warning: STORE_DIR is deprecated; write --offload-dir", args.store_dir,
              file=sys.stderr)
    args.store_dir = args.offload_dir or args.store_dir or str(default_store(args.model_dir, args.quant))
    try:
        pack(args.model_dir, args.store_dir, quant=quant, codec=CODEC if args.compress else None,
             progress=not args.no_progress, verify_existing=True)
    except (StoreError, ValueError, FileNotFoundError) as exc:
        print(f"moeinf pack: error: {exc}", file=sys.stderr)
        return 1
    store = Store(args.store_dir)
    index = store.index
    summary = {
        "store_dir": str(store.dir), "fingerprint": index.fingerprint, "model_type": index.model_type,
        "family": index.family, "dtype": index.dtype, "num_layers": index.num_layers,
        "num_experts": index.num_experts, "top_k": index.top_k, "expert_bytes": store.expert_bytes,
        "max_blob_size": store.max_blob_size, "quant": index.quant and {
            k: index.quant[k] for k in ("scheme", "group_size")},
        "codec": index.codec, "stored_bytes": store.stored_bytes,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{store.dir}: {index.model_type}, {index.num_layers} MoE layers x {index.num_experts} "
              f"experts, {store.expert_bytes / 2**20:.1f} MiB of experts ({_weights(index)}"
              f"{f', {store.stored_bytes / 2**20:.1f} MiB on disk' if index.codec else ''}), fingerprint "
              f"{index.fingerprint[:16]}")
    return 0


def default_store(model: str, quant: str | None) -> Path:
    """Where the runtime looks for `model`'s store by default (`moeinf.builder.store_plan`)."""
    from moeinf.api import with_model_defaults
    from moeinf.builder import default_offload_dir
    from moeinf.config import OffloadConfig

    ref = getattr(model, "ref", None)
    config = OffloadConfig(quant=quant or "none")
    if ref is not None:
        config = with_model_defaults(config, ref)
    return Path(config.offload_dir) if config.offload_dir else default_offload_dir(Path(model), config.quant)


def _weights(index: StoreIndex) -> str:
    """The experts' weight format: the dtype, or the quantisation and the dtype of its scales."""
    if index.quant is None:
        return index.dtype if index.codec is None else f"{index.dtype}, stored coded {index.codec}"
    group = index.quant["group_size"]
    return f"{index.quant['scheme']}{f', group {group}' if group else ', per row'}, {index.dtype} scales"
