"""Decode step of a quantised store with a decoded row's gated experts in one kernel call (`gated_rows`, "new")
against the per-expert path it replaced ("old": bound products, the SiLU gate kernel and torch's weighting one
expert at a time, shared experts likewise), all experts resident, modes alternating round by round in one
process; medians, the ratio the median of the rounds' ratios.

    T=2 python ab.py .moeinf-int4 ROUNDS"""
import os, sys, time, statistics, torch
from pathlib import Path
from transformers import DynamicCache
from moeinf import MoE, OffloadConfig
from moeinf.bench.quant import speed_inputs
from moeinf.runtime import quant_compute, quant_dense
torch.set_num_threads(int(os.environ.get("T", "2")))
MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")
store = MODEL.with_name(MODEL.name + sys.argv[1]); rounds = int(sys.argv[2])
ids = speed_inputs(MODEL, 1)[0]
NEW = quant_compute.QuantisedGatedKernel.rows_into
with MoE(MODEL, OffloadConfig(offload_dir=str(store), device_cache="100%", prefetch="none")) as moe, torch.inference_mode():
    model = moe.model
    mlps = [m for m in model.modules() if isinstance(m, quant_dense.FusedGatedMLP)]
    def mode(new):
        quant_compute.QuantisedGatedKernel.rows_into = NEW if new else (lambda *a: False)
        for m in mlps:
            m.silu_fused = new
    orig = quant_dense.FusedGatedMLP.forward
    def fwd(self, x):
        if getattr(self, "silu_fused", True) or x.numel() != x.shape[-1]:
            return orig(self, x)
        h = self.gate_up_proj(x)
        g = quant_compute.silu_mul_row(h.reshape(1, -1))
        return self.down_proj(g.view(*h.shape[:-1], self.intermediate))
    quant_dense.FusedGatedMLP.forward = fwd
    moe.generate(ids, max_new_tokens=4, do_sample=False)
    steps = {"old": [], "new": []}
    for _ in range(rounds):
        for name in ("old", "new"):
            mode(name == "new")
            cache = DynamicCache(config=model.config)
            token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            t = time.perf_counter()
            for _ in range(24):
                token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            steps[name].append((time.perf_counter() - t) / 24 * 1e3)
    r = statistics.median(n / o for n, o in zip(steps["new"], steps["old"]))
    print(sys.argv[1], {k: round(statistics.median(v), 2) for k, v in steps.items()}, "new/old", round(r, 3))
