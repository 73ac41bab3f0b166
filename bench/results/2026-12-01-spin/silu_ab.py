import os, sys, time, torch, statistics, collections
from pathlib import Path
from moeinf import MoE, OffloadConfig
from moeinf.bench.quant import speed_inputs
from transformers import DynamicCache
torch.set_num_threads(int(os.environ.get("T","2")))
M = Path("/work/bench-data/e2e-zoo-full-2048x768")
quant = sys.argv[1]
store = M.with_name(M.name + (".moeinf" if quant == "none" else f".moeinf-{quant}"))
cfg = OffloadConfig(offload_dir=str(store), device_cache="100%", prefetch="none")
ids = speed_inputs(M, 1)[0]
acc = collections.Counter()
stack = []
def wrap(mod, name):
    f = mod.forward
    def g(*a, **k):
        t = time.perf_counter_ns(); stack.append(0)
        try: return f(*a, **k)
        finally:
            el = time.perf_counter_ns() - t; child = stack.pop()
            acc[name] += el - child
            if stack: stack[-1] += el
    mod.forward = g
with MoE(M, cfg) as moe, torch.inference_mode():
    model = moe.model
    for l in model.model.layers:
        wrap(l.self_attn, "attn"); wrap(l.mlp.shared_experts, "shared"); wrap(l.mlp.gate, "gate"); wrap(l.mlp.experts, "experts")
        wrap(l.input_layernorm, "norm"); wrap(l.post_attention_layernorm, "norm"); wrap(l.mlp, "moe-block"); wrap(l, "layer")
        for n, m in l.self_attn.named_modules():
            if n and type(m).__name__ in ("QuantisedLinear",): wrap(m, "attn.linear")
    wrap(model.lm_head, "lm_head"); wrap(model.model, "model"); wrap(model, "top")
    moe.generate(ids, max_new_tokens=4, do_sample=False)
    cache = DynamicCache(config=model.config)
    out = model(ids, past_key_values=cache, use_cache=True); tok = out.logits[:, -1:].argmax(-1)
    for _ in range(3): out = model(tok, past_key_values=cache, use_cache=True); tok = out.logits[:, -1:].argmax(-1)
    import os
    modes = sys.argv[2].split(",")
    res = collections.defaultdict(list); per = collections.defaultdict(lambda: collections.defaultdict(list))
    for rnd in range(int(sys.argv[3]) if len(sys.argv) > 3 else 5):
        for mode in modes:
            import moeinf.runtime.quant_compute as _qc, moeinf.runtime.quant_dense as _qd
            if not hasattr(_qc, "_orig_silu"):
                _qc._orig_silu = _qc.silu_mul_row
            f = (lambda h: None) if mode == "old" else _qc._orig_silu
            _qc.silu_mul_row = _qd.silu_mul_row = f
            cache = DynamicCache(config=model.config)
            out = model(ids, past_key_values=cache, use_cache=True); tok = out.logits[:, -1:].argmax(-1)
            acc.clear(); n = 24
            t = time.perf_counter_ns()
            for _ in range(n): out = model(tok, past_key_values=cache, use_cache=True); tok = out.logits[:, -1:].argmax(-1)
            res[mode].append((time.perf_counter_ns() - t) / n / 1e6)
            for k, v in acc.items(): per[mode][k].append(v / n / 1e6)
for mode in modes:
    print(quant, "mode", mode, "cpu ms/step", round(statistics.median(res[mode]), 2), "ratio to first", round(statistics.median([a / b for a, b in zip(res[mode], res[modes[0]])]), 3))
    print("   ", {k: round(statistics.median(v), 2) for k, v in sorted(per[mode].items(), key=lambda kv: -statistics.median(kv[1]))})
