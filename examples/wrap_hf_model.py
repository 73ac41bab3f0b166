"""Wrap a HuggingFace MoE checkpoint with moeinf, generate, and read the expert-cache statistics.

    python examples/wrap_hf_model.py                          # the zoo model that ships with moeinf
    python examples/wrap_hf_model.py path/to/checkpoint --device-cache 25%
    python examples/wrap_hf_model.py org/name                 # a HuggingFace id (from the hub cache)

The experts are packed into an expert store on first use (`--store`, default MODEL.moeinf beside a
checkpoint directory; zoo and hub models' stores go to $MOEINF_CACHE). Only `--device-cache` of the
expert bytes stay in memory: the other experts are read from the store when the runtime predicts
(prefetch) or meets (miss) a need for them.
"""

from __future__ import annotations

import argparse

from moeinf import MoE, OffloadConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="full",
                        help="checkpoint directory, zoo model name or HuggingFace id (default: full)")
    parser.add_argument("--device-cache", default="25%", help="memory for experts: '25%%' or '2GiB'")
    parser.add_argument("--store", default=None, help="expert store directory")
    parser.add_argument("--prompt", default="What is the capital of France?")
    args = parser.parse_args()

    with MoE(args.model, OffloadConfig(device_cache=args.device_cache, offload_dir=args.store)) as model:
        ids = model.tokenizer(args.prompt, return_tensors="pt").input_ids  # [1, T]
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
        print(model.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
        stats = model.stats()

    # Counters since the model was loaded (definitions: moeinf/runtime/stats.py).
    print(f"expert accesses {stats['accesses']}: hits {stats['hits']}, misses {stats['misses']}, "
          f"hit rate {stats['hit_rate']:.2f}")
    print(f"prefetches {stats['prefetches']} (precision {stats['prefetch_precision']:.2f}, "
          f"recall {stats['prefetch_recall']:.2f}); read {stats['bytes_read'] / 2**20:.1f} MiB from the "
          f"store, waited {stats['stall_s']:.2f} s for it")


if __name__ == "__main__":
    main()
