"""Convert a HuggingFace checkpoint directory (config.json + *.safetensors) into an expert store:
one 4 KiB-aligned blob per expert in experts.bin, dense weights in dense.safetensors, an index.
Re-packing the same model into its store does nothing; another model's store is never overwritten."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from moeinf.commands import options

if TYPE_CHECKING:
    from moeinf.store import StoreIndex


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src_dir", metavar="SRC_DIR", type=options.model_dir,
                        help="HuggingFace checkpoint directory (config.json and safetensors weights)")
    parser.add_argument("store_dir", metavar="STORE_DIR", help="where to write the store (created)")
    parser.add_argument("--quant", choices=("int8", "int4"), default=None,
                        help="quantise the experts' weights (dense weights stay as they are): int8 with one "
                             "scale per output row, int4 with a scale and zero per group (default: exact)")
    parser.add_argument("--group-size", type=int, default=None,
                        help="int4: inputs per scale and zero, one of 32, 64, 128, 256 (default 32); int8: "
                             "only 0 (one scale per row)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    parser.add_argument("--no-progress", action="store_true", help="do not show a progress bar")


def run(args: argparse.Namespace) -> int:
    from moeinf.store import Store, StoreError, pack
    from moeinf.store.quant import Quantization

    if args.group_size is not None and args.quant is None:
        print("moeinf pack: error: --group-size needs --quant", file=sys.stderr)
        return 2
    try:
        quant = Quantization.of(args.quant, args.group_size) if args.quant else None
    except ValueError as exc:
        print(f"moeinf pack: error: --group-size: {exc}", file=sys.stderr)
        return 2
    try:
        pack(args.src_dir, args.store_dir, quant=quant, progress=not args.no_progress and sys.stderr.isatty())
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
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{store.dir}: {index.model_type}, {index.num_layers} MoE layers x {index.num_experts} "
              f"experts, {store.expert_bytes / 2**20:.1f} MiB of experts ({_weights(index)}), fingerprint "
              f"{index.fingerprint[:16]}")
    return 0


def _weights(index: StoreIndex) -> str:
    """The experts' weight format: the dtype, or the quantisation and the dtype of its scales."""
    if index.quant is None:
        return index.dtype
    group = index.quant["group_size"]
    return f"{index.quant['scheme']}{f', group {group}' if group else ', per row'}, {index.dtype} scales"
