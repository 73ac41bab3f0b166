"""Where a quantised store's all-in-RAM decode step goes, by torch op (a diagnostic, not a benchmark).

Decodes one held-out prompt on the e2e model's int8 or int4 store with every expert in RAM, then profiles
16 more decode steps with torch.profiler (CPU) and prints the ops by self CPU time, per decode step.

    python profile_decode.py int4 [--threads 2] [--config '{"mla_absorb": false}']
"""
import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from moeinf import MoE, OffloadConfig
from moeinf.bench.e2e import heldout_texts
from moeinf.zoo.tokenizer import chat_text

MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")

ap = argparse.ArgumentParser()
ap.add_argument("quant", choices=["none", "int8", "int4"])
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--config", default="{}")
ap.add_argument("--steps", type=int, default=16)
args = ap.parse_args()
torch.set_num_threads(args.threads)
store = MODEL.with_name(MODEL.name + (".moeinf" if args.quant == "none" else f".moeinf-{args.quant}"))
config = OffloadConfig.from_dict({"offload_dir": str(store), "quant": args.quant, "device_cache": "100%",
                                  "prefetch": "none", **json.loads(args.config)})
with MoE(MODEL, config) as moe:
    ids = moe.tokenizer(chat_text(heldout_texts(1, 0)[0]), return_tensors="pt").input_ids
    with torch.inference_mode():
        moe.generate(ids, max_new_tokens=8, do_sample=False)  # warm: every expert resident, kernels ready
        out = moe.generate(ids, max_new_tokens=1, do_sample=False)
        from transformers import DynamicCache

        cache = DynamicCache(config=moe.model.config)
        step = moe.model(ids, past_key_values=cache, use_cache=True)
        token = step.logits[:, -1:].argmax(-1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step = moe.model(token, past_key_values=cache, use_cache=True)
                token = step.logits[:, -1:].argmax(-1)
table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3 / args.steps
print(f"{args.quant} {args.config}: {total:.2f} ms of self CPU time per decode step (profiled)")
print(table)
