"""A quantised store's all-in-RAM decode step against the context length, `mla_absorb` on and off.

Per context length (tokens already in the cache), in one process with both models loaded: prefill a
held-out prompt repeated to that length, then time 16 greedy one-row decode steps; alternating on/off
for --rounds rounds; medians of the per-step wall times.

    python absorb_context.py int4 --lengths 64,512,2048 --threads 2
"""
import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from moeinf import MoE, OffloadConfig
from moeinf.bench.e2e import heldout_texts

MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")

ap = argparse.ArgumentParser()
ap.add_argument("quant", choices=["int8", "int4"])
ap.add_argument("--lengths", default="64,512,2048")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--steps", type=int, default=16)
args = ap.parse_args()
torch.set_num_threads(args.threads)
store = MODEL.with_name(MODEL.name + f".moeinf-{args.quant}")
models = {}
for absorb in (False, True):
    config = OffloadConfig(offload_dir=str(store), quant=args.quant, device_cache="100%", prefetch="none",
                           mla_absorb=absorb)
    models[absorb] = MoE(MODEL, config)
tokenizer = models[True].tokenizer
text = " ".join(heldout_texts(40, 0))
all_ids = tokenizer(text, return_tensors="pt").input_ids


def steps_ms(moe: MoE, length: int) -> list[float]:
    ids = all_ids[:, :length]
    cache = DynamicCache(config=moe.model.config)
    out = moe.model(ids, cache=cache, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        out = moe.model(token, cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        times.append((time.perf_counter() - start) * 1e3)
    return times


with torch.inference_mode():
    for moe in models.values():  # warm: every expert resident, kernels ready
        steps_ms(moe, 32)
    for length in map(int, args.lengths.split(",")):
        got = {False: [], True: []}
        for _ in range(args.rounds):
            for absorb, moe in models.items():
                got[absorb] += steps_ms(moe, length)
        off, on = statistics.median(got[False]), statistics.median(got[True])
        print(f"{args.quant} context {length}: mla_absorb off {off:.2f} ms/step, on {on:.2f} ms/step "
              f"(on/off {on / off:.3f})", flush=True)
for moe in models.values():
    moe.close()
