"""Trace prompts into an EAMC, then let the runtime predict from it.

    python examples/trace_eamc.py                      # the zoo model, 8 prompts, into a temporary dir
    python examples/trace_eamc.py path/to/checkpoint --limit 50 --out traces/my-model.eamc

An EAM (expert activation matrix) counts, for one sequence, the tokens each expert of each MoE layer
served. `moeinf trace` runs the unmodified model on prompts, records one EAM per sequence and keeps a
collection of representative ones (the EAMC, by K-Means). Given to `OffloadConfig(eamc=...)`, it lets the
runtime match a new sequence to the nearest traced one and prefetch the experts that sequence used.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from moeinf import MoE, OffloadConfig
from moeinf.cli import main as moeinf
from moeinf.trace import EAMC
from moeinf.zoo.corpus import PROMPTS_DIR


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="full",
                        help="checkpoint directory, zoo model name or HuggingFace id (default: full)")
    parser.add_argument("--limit", type=int, default=4, help="prompts traced from each prompt file")
    parser.add_argument("--out", default=None, help="EAMC file to write (default: in a temporary directory)")
    args = parser.parse_args()
    out = args.out or str(Path(tempfile.mkdtemp(prefix="moeinf-example-")) / "example.eamc")

    prompts = [str(PROMPTS_DIR / "mt_bench.jsonl"), str(PROMPTS_DIR / "gsm8k_test.jsonl")]
    # the command line's `moeinf trace`, called in-process (--lookahead-depth 0: the EAMC only, without
    # the learned look-ahead predictor it also fits by default)
    status = moeinf(["trace", args.model, "--prompts", *prompts, "--limit", str(args.limit),
                     "--max-new-tokens", "8", "--capacity", "8", "--lookahead-depth", "0", "--out", out])
    if status != 0:
        raise SystemExit(status)
    eamc = EAMC.load(out)
    print(f"{out}: {eamc.capacity} EAMs of {eamc.num_layers} MoE layers x {eamc.num_experts} experts")

    with MoE(args.model, OffloadConfig(device_cache="25%", eamc=out)) as model:
        ids = model.tokenizer("Write a short poem about the sea.", return_tensors="pt").input_ids
        model.generate(ids, max_new_tokens=16, do_sample=False)
        stats = model.stats()
    print(f"with the EAMC: prefetches {stats['prefetches']}, prefetch recall {stats['prefetch_recall']:.2f}, "
          f"hit rate {stats['hit_rate']:.2f}")


if __name__ == "__main__":
    main()
