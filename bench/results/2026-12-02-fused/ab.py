"""Decode step of a quantised store with one change switched off ("old") and on ("new"), all experts resident,
modes alternating round by round in one process; medians, the ratio the median of the rounds' ratios.

    T=2 python ab.py SWITCH .moeinf-int4 ROUNDS

SWITCH:
  fused    a decoded row's gated experts in one kernel call (`gated_rows`, 603d47e) against the per-expert
           path it replaced (bound products, the SiLU gate kernel and torch's weighting one expert at a time,
           the shared experts likewise)
  threads  a wave's experts one per thread inside `gated_rows` (585704e) against each product split between
           the threads (the wave handed over one expert at a time)"""
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from moeinf import MoE, OffloadConfig
from moeinf.bench.quant import speed_inputs
from moeinf.runtime import gemv, quant_compute, quant_dense

torch.set_num_threads(int(os.environ.get("T", "2")))
MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")
switch, store, rounds = sys.argv[1], MODEL.with_name(MODEL.name + sys.argv[2]), int(sys.argv[3])
ids = speed_inputs(MODEL, 1)[0]
NEW, GATED, FORWARD = quant_compute.QuantisedGatedKernel.rows_into, gemv.gated_rows, quant_dense.FusedGatedMLP.forward
OLD = {"on": False}


def per_expert_mlp(self, x):
    """FusedGatedMLP.forward before 603d47e: two products and the SiLU gate kernel."""
    if not OLD["on"] or x.numel() != x.shape[-1]:
        return FORWARD(self, x)
    h = self.gate_up_proj(x)
    g = quant_compute.silu_mul_row(h.reshape(1, -1))
    return self.down_proj(g.view(*h.shape[:-1], self.intermediate))


def one_at_a_time(x, experts, weights, out):
    """A wave handed to gated_rows one expert at a time: each product split between the threads."""
    if not OLD["on"]:
        return GATED(x, experts, weights, out)
    for expert in experts:
        GATED(x, [expert], weights, out)


def mode(new):
    OLD["on"] = not new
    if switch == "fused":
        quant_compute.QuantisedGatedKernel.rows_into = NEW if new else (lambda *a: False)


if switch == "fused":
    quant_dense.FusedGatedMLP.forward = per_expert_mlp
elif switch == "threads":
    quant_compute.gemv.gated_rows = one_at_a_time
else:
    raise SystemExit(f"unknown switch {switch!r}")
with MoE(MODEL, OffloadConfig(offload_dir=str(store), device_cache="100%", prefetch="none")) as moe, \
        torch.inference_mode():
    model = moe.model
    moe.generate(ids, max_new_tokens=4, do_sample=False)
    steps = {"old": [], "new": []}
    for _ in range(rounds):
        for name in ("old", "new"):
            mode(name == "new")
            cache = DynamicCache(config=model.config)
            token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            start = time.perf_counter()
            for _ in range(24):
                token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            steps[name].append((time.perf_counter() - start) / 24 * 1e3)
    ratio = statistics.median(n / o for n, o in zip(steps["new"], steps["old"]))
    print(switch, sys.argv[2], {k: round(statistics.median(v), 2) for k, v in steps.items()}, "new/old",
          round(ratio, 3))
