"""Trace prompts into an EAMC, then let the runtime predict from it.

    python examples/trace_eamc.py                      # the zoo model, 8 prompts from two prompt sets
    python examples/trace_eamc.py path/to/checkpoint --limit 50 --out traces/my-model.eamc

An EAM (expert activation matrix) counts, for one sequence, the tokens each expert of each MoE layer
served. `moeinf trace` runs the unmodified model on prompts, records one EAM per sequence and keeps a
collection of representative ones (the EAMC, by K-Means). Given to `OffloadConfig(eamc=...)`, it lets the
runtime match a new sequence to the nearest traced one and prefetch the experts that sequence used.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moeinf import MoE, OffloadConfig
from moeinf.cli import main as moeinf
from moeinf.trace import EAMC
from moeinf.zoo import get_model, store_dir
from moeinf.zoo.corpus import PROMPTS_DIR


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", nargs="?", help="HuggingFace checkpoint directory (default: zoo model)")
    parser.add_argument("--limit", type=int, default=4, help="prompts traced from each prompt file")
    parser.add_argument("--out", default="example.eamc", help="EAMC file to write")
    args = parser.parse_args()

    model_dir = Path(args.model_dir) if args.model_dir else get_model("full")
    prompts = [str(PROMPTS_DIR / "mt_bench.jsonl"), str(PROMPTS_DIR / "gsm8k_test.jsonl")]
    # the command line's `moeinf trace`, called in-process (--lookahead-depth 0: the EAMC only, without
    # the learned look-ahead predictor it also fits by default)
    status = moeinf(["trace", str(model_dir), "--prompts", *prompts, "--limit", str(args.limit),
                     "--max-new-tokens", "8", "--capacity", "8", "--lookahead-depth", "0", "--out", args.out])
    if status != 0:
        raise SystemExit(status)
    eamc = EAMC.load(args.out)
    print(f"{args.out}: {eamc.capacity} EAMs of {eamc.num_layers} MoE layers x {eamc.num_experts} experts")

    store = None if args.model_dir else str(store_dir(model_dir))
    config = OffloadConfig(device_cache="25%", eamc=args.out, offload_dir=store)
    with MoE(model_dir, config) as model:
        ids = model.tokenizer("Write a short poem about the sea.", return_tensors="pt").input_ids
        model.generate(ids, max_new_tokens=16, do_sample=False)
        stats = model.stats()
    print(f"with the EAMC: prefetches {stats['prefetches']}, prefetch recall {stats['prefetch_recall']:.2f}, "
          f"hit rate {stats['hit_rate']:.2f}")


if __name__ == "__main__":
    main()
