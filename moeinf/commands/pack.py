"""Convert a HuggingFace checkpoint directory (config.json + *.safetensors) into an expert store:
one 4 KiB-aligned blob per expert in experts.bin, dense weights in dense.safetensors, an index.
Re-packing the same model into its store does nothing; another model's store is never overwritten."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src_dir", metavar="SRC_DIR", help="HuggingFace model directory")
    parser.add_argument("store_dir", metavar="STORE_DIR", help="where to write the store (created)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    parser.add_argument("--no-progress", action="store_true", help="do not show a progress bar")


def run(args: argparse.Namespace) -> int:
    from moeinf.store import Store, StoreError, pack

    try:
        pack(args.src_dir, args.store_dir, progress=not args.no_progress and sys.stderr.isatty())
    except (StoreError, ValueError, FileNotFoundError) as exc:
        print(f"moeinf pack: error: {exc}", file=sys.stderr)
        return 1
    store = Store(args.store_dir)
    index = store.index
    summary = {
        "store_dir": str(store.dir), "fingerprint": index.fingerprint, "model_type": index.model_type,
        "family": index.family, "dtype": index.dtype, "num_layers": index.num_layers,
        "num_experts": index.num_experts, "top_k": index.top_k, "expert_bytes": store.expert_bytes,
        "max_blob_size": store.max_blob_size,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{store.dir}: {index.model_type}, {index.num_layers} MoE layers x {index.num_experts} "
              f"experts, {store.expert_bytes / 2**20:.1f} MiB of experts ({index.dtype}), fingerprint "
              f"{index.fingerprint[:16]}")
    return 0
