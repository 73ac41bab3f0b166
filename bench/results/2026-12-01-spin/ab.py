"""Per-module wall time of a decoded token, all experts resident, with one change switched on and off in the
same process, modes alternating round by round (medians; the step ratio is the median of the rounds' ratios).

    T=2 python ab.py STORE SWITCH MODES ROUNDS      e.g.  T=2 python ab.py int8 silu old,new 5

STORE: none, int8 or int4 (the stores beside /work/bench-data/e2e-zoo-full-2048x768). SWITCH and its MODES:
  spin        helper spin in us (0,200,1000...)     the GEMV helpers' spin before sleeping (d6794f3)
  rowproduct  old,new                                bound one-row products (190c51e)
  router      old,new                                router logits in the kernels module (2a00ce3)
  silu        old,new                                the SiLU gate in one call (865e346)
Times include the wrappers' own cost (a few us per call), the same in every mode."""

import collections
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from moeinf import MoE, OffloadConfig, _kernels
from moeinf.bench.quant import speed_inputs
from moeinf.runtime import gemv, quant_compute, quant_dense, routers

torch.set_num_threads(int(os.environ.get("T", "2")))
MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")


def router_before(self, hidden_states):
    """GroupFreeTopkRouter.forward of a decoded row before 2a00ce3: torch's float32 product of the widened copy."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    logits = F.linear(hidden_states.type(torch.float32), self.weight_float32())
    bias = self.e_score_correction_bias
    weights, ids = torch.empty(1, self.top_k), torch.empty(1, self.top_k, dtype=torch.long)
    _kernels.sigmoid_topk(logits.data_ptr(), bias.data_ptr(), gemv.DTYPES[bias.dtype], self.num_experts,
                          self.top_k, self.norm_topk_prob, float(self.routed_scaling_factor), weights.data_ptr(),
                          ids.data_ptr())
    return logits, weights, ids


ORIGINAL = {"router": routers.GroupFreeTopkRouter.forward, "silu": quant_compute.silu_mul_row,
            "linear": quant_dense.QuantisedLinear.row_product, "kernel": quant_compute.QuantisedGatedKernel.row_product}


def switch(name, mode, model):
    if name == "spin":
        pool = _kernels.Workers(torch.get_num_threads(), int(mode))
        gemv.workers = lambda threads: pool
    elif name == "router":
        routers.GroupFreeTopkRouter.forward = router_before if mode == "old" else ORIGINAL["router"]
    elif name == "silu":
        quant_compute.silu_mul_row = quant_dense.silu_mul_row = \
            (lambda h: None) if mode == "old" else ORIGINAL["silu"]
    elif name == "rowproduct":
        old = mode == "old"
        quant_dense.QuantisedLinear.row_product = (lambda self: None) if old else ORIGINAL["linear"]
        quant_compute.QuantisedGatedKernel.row_product = (lambda self, *a: None) if old else ORIGINAL["kernel"]
        for module in model.modules():  # forget what the other mode bound
            if isinstance(module, quant_dense.QuantisedLinear):
                module._row = None
            if isinstance(getattr(module, "kernel", None), quant_compute.QuantisedGatedKernel):
                module.kernel.rows.clear()
    else:
        raise SystemExit(f"unknown switch {name!r}")


def main():
    store_name, name, modes, rounds = sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4])
    store = MODEL.with_name(MODEL.name + (".moeinf" if store_name == "none" else f".moeinf-{store_name}"))
    ids = speed_inputs(MODEL, 1)[0]
    spent, stack = collections.Counter(), []

    def timed(module, label):
        forward = module.forward

        def wrapper(*args, **kwargs):
            start = time.perf_counter_ns()
            stack.append(0)
            try:
                return forward(*args, **kwargs)
            finally:
                elapsed, inner = time.perf_counter_ns() - start, stack.pop()
                spent[label] += elapsed - inner
                if stack:
                    stack[-1] += elapsed

        module.forward = wrapper

    config = OffloadConfig(offload_dir=str(store), device_cache="100%", prefetch="none")
    with MoE(MODEL, config) as moe, torch.inference_mode():
        model = moe.model
        for layer in model.model.layers:
            for label, module in (("attn", layer.self_attn), ("shared", layer.mlp.shared_experts),
                                  ("gate", layer.mlp.gate), ("experts", layer.mlp.experts),
                                  ("norm", layer.input_layernorm), ("norm", layer.post_attention_layernorm),
                                  ("moe-block", layer.mlp), ("layer", layer)):
                timed(module, label)
            for child in layer.self_attn.modules():
                if isinstance(child, quant_dense.QuantisedLinear):
                    timed(child, "attn.linear")
        for label, module in (("lm_head", model.lm_head), ("model", model.model), ("top", model)):
            timed(module, label)
        moe.generate(ids, max_new_tokens=4, do_sample=False)
        steps, parts = collections.defaultdict(list), collections.defaultdict(lambda: collections.defaultdict(list))
        for _ in range(rounds):
            for mode in modes:
                switch(name, mode, model)
                cache = DynamicCache(config=model.config)
                token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                spent.clear()
                count, start = 24, time.perf_counter_ns()
                for _ in range(count):
                    token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                steps[mode].append((time.perf_counter_ns() - start) / count / 1e6)
                for label, ns in spent.items():
                    parts[mode][label].append(ns / count / 1e6)
    for mode in modes:
        ratio = statistics.median(a / b for a, b in zip(steps[mode], steps[modes[0]]))
        print(store_name, "mode", mode, "ms/step", round(statistics.median(steps[mode]), 2), "ratio to first",
              round(ratio, 3))
        print("   ", {k: round(statistics.median(v), 2)
                      for k, v in sorted(parts[mode].items(), key=lambda kv: -statistics.median(kv[1]))})


if __name__ == "__main__":
    main()
