"""Where a decoded token of a quantised store goes, all experts resident: exclusive wall time per token of each
decoder-layer part (wrappers on the module instances), the kernels module's two product calls counted apart
("C:"), five rounds of 32 tokens, medians.

    T=2 python layer.py .moeinf-int4"""
import os, sys, time, collections, torch
from pathlib import Path
from transformers import DynamicCache
from moeinf import MoE, OffloadConfig
from moeinf.bench.quant import speed_inputs
from moeinf.runtime import gemv
torch.set_num_threads(int(os.environ.get("T", "2")))
MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")
store = MODEL.with_name(MODEL.name + sys.argv[1])
ids = speed_inputs(MODEL, 1)[0]
spent = collections.Counter(); stack = []
def timed(label, f):
    def w(*a, **k):
        t = time.perf_counter_ns(); stack.append(0)
        try: return f(*a, **k)
        finally:
            e = time.perf_counter_ns() - t; inner = stack.pop(); spent[label] += e - inner
            if stack: stack[-1] += e
    return w
gemv._kernels = type("K", (), {n: staticmethod(timed("C:" + n, getattr(gemv._kernels, n))) for n in ("row_weight_product", "gated_rows")} | {n: getattr(gemv._kernels, n) for n in dir(gemv._kernels) if not n.startswith("_") and n not in ("row_weight_product", "gated_rows")})
with MoE(MODEL, OffloadConfig(offload_dir=str(store), device_cache="100%", prefetch="none")) as moe, torch.inference_mode():
    model = moe.model
    for layer in model.model.layers:
        for label, m in (("in_norm", layer.input_layernorm), ("post_norm", layer.post_attention_layernorm), ("attn", layer.self_attn), ("moe", layer.mlp), ("layer", layer)):
            m.forward = timed(label, m.forward)
        if hasattr(layer.mlp, "gate"):
            for label, m in (("router", layer.mlp.gate), ("experts", layer.mlp.experts), ("shared", layer.mlp.shared_experts)):
                m.forward = timed(label, m.forward)
        for name, m in layer.self_attn.named_modules():
            if name and hasattr(m, "forward") and "proj" in name:
                m.forward = timed("attn." + type(m).__name__, m.forward)
    cache = DynamicCache(config=model.config)
    token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    res = collections.defaultdict(list); steps = []
    for r in range(5):
        spent.clear(); N = 32; t = time.perf_counter_ns()
        for _ in range(N):
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        steps.append((time.perf_counter_ns() - t) / N / 1e3)
        for k, v in spent.items(): res[k].append(v / N / 1e3)
    import statistics
    print("us/token", [round(s) for s in steps])
    for k, v in sorted(res.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"{statistics.median(v):8.0f} us/token {k}")
