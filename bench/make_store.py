"""Write an expert store with Qwen3-30B-A3B expert geometry for `moeinf bench io`.

Each expert is bf16 gate_up [1536, 2048] + down [2048, 768] = 9,437,184 bytes (hidden 2048, expert
intermediate 768), so 2 MoE layers x 128 experts make a 2.4 GB store. By default a real Qwen3-MoE
checkpoint of that geometry (2 layers, small vocabulary, random weights) is built from its transformers
config, saved with `save_pretrained` and packed with `moeinf.store.pack`, so the store is exactly what
the runtime reads. `--raw` writes random blobs and the index directly instead (no transformers).

    python bench/make_store.py                      # -> $MOEINF_CACHE/bench/qwen3-30b-a3b-geometry.store
    moeinf bench io $MOEINF_CACHE/bench/qwen3-30b-a3b-geometry.store --json
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

import numpy as np

HIDDEN = 2048
EXPERT_INTERMEDIATE = 768
DEFAULT_NAME = "qwen3-30b-a3b-geometry.store"
"""The store's directory under $MOEINF_CACHE/bench when --out is not given."""

log = logging.getLogger("make_store")


def build_checkpoint(src: Path, layers: int, experts: int) -> Path:
    """A Qwen3-MoE checkpoint with the expert geometry of Qwen3-30B-A3B and a tiny vocabulary."""
    from moeinf.hf.tiny import save_tiny

    return save_tiny(
        "qwen3_moe", src, dtype="bfloat16", hidden_size=HIDDEN, moe_intermediate_size=EXPERT_INTERMEDIATE,
        intermediate_size=6144, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=experts, num_experts_per_tok=8,
    )


def write_raw(out: Path, layers: int, experts: int, seed: int) -> None:
    """Random expert blobs and an index in the store format (docs/internals.md), without a model."""
    from moeinf.store.checksum import ALGORITHM, checksum

    gate_up = (2 * EXPERT_INTERMEDIATE, HIDDEN)
    down = (HIDDEN, EXPERT_INTERMEDIATE)
    down_offset = 2 * gate_up[0] * gate_up[1]
    nbytes = down_offset + 2 * down[0] * down[1]
    size = -(-nbytes // 4096) * 4096
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True)
    entries = []
    with open(out / "experts.bin", "wb") as f:
        for layer in range(layers):
            for expert in range(experts):
                blob = np.zeros(size, dtype=np.uint8)
                blob[:nbytes] = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
                entries.append({
                    "layer": layer, "expert": expert, "file": 0, "offset": f.tell(), "size": size,
                    "nbytes": nbytes, "checksum": checksum(blob),
                    "tensors": {
                        "gate_up_proj": {"dtype": "bfloat16", "shape": list(gate_up), "offset": 0},
                        "down_proj": {"dtype": "bfloat16", "shape": list(down), "offset": down_offset},
                    },
                })
                f.write(blob.tobytes())
    index = {
        "format": "moeinf-store", "version": 1, "fingerprint": f"raw-benchmark-store-seed-{seed}",
        "model_type": "qwen3_moe", "family": "qwen-moe", "dtype": "bfloat16", "alignment": 4096,
        "checksum": ALGORITHM, "files": ["experts.bin"], "dense": "dense.safetensors",
        "num_layers": layers, "num_experts": experts, "top_k": 8,
        "modules": [f"model.layers.{i}.mlp.experts" for i in range(layers)], "experts": entries,
    }
    (out / "moeinf-store.json").write_text(json.dumps(index))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"store directory (default: $MOEINF_CACHE/bench/{DEFAULT_NAME})")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--raw", action="store_true", help="write random blobs + index, no checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.out is None:
        from moeinf.zoo import cache_root

        args.out = cache_root() / "bench" / DEFAULT_NAME
        args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.exists():
        log.error("%s exists; remove it or pass --out", args.out)
        return 1
    if args.raw:
        write_raw(args.out, args.layers, args.experts, args.seed)
    else:
        from moeinf.store import pack

        src = args.out.with_name(args.out.name + ".src")
        shutil.rmtree(src, ignore_errors=True)
        log.info("building a %d-layer, %d-expert Qwen3-MoE checkpoint in %s", args.layers, args.experts, src)
        build_checkpoint(src, args.layers, args.experts)
        log.info("packing it into %s", args.out)
        pack(src, args.out, progress=sys.stderr.isatty())
        shutil.rmtree(src)
    total = sum(e["size"] for e in json.loads((args.out / "moeinf-store.json").read_text())["experts"])
    log.info("%s: %.2f GB of experts", args.out, total / 1e9)
    return 0


if __name__ == "__main__":
    sys.exit(main())
