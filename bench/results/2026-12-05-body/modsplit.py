import time, torch, statistics, sys, collections
from pathlib import Path
from moeinf import MoE, OffloadConfig
from moeinf.bench.quant import speed_inputs
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")
quant = sys.argv[1]
store = {"int4": ".moeinf-int4", "int8": ".moeinf-int8", "none": ".moeinf"}[quant]
ids = speed_inputs(MODEL, 1)[0]
acc = collections.defaultdict(float)
def timed(mod, key):
    f = mod.forward
    def w(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[key] += time.perf_counter() - t; return r
    mod.forward = w
with MoE(MODEL, OffloadConfig(offload_dir=str(MODEL) + store, quant=quant, device_cache="100%")) as moe:
    m = moe.model
    timed(m.lm_head, "lm_head")
    for l in m.model.layers:
        timed(l, "layer")
        for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
            timed(getattr(l, name), name)
        for name in ("gate", "experts", "shared_experts"):
            timed(getattr(l.mlp, name), "mlp." + name)
        for name, sub in l.self_attn.named_children():
            timed(sub, "attn." + name)
    snaps = []
    h = m.register_forward_hook(lambda mod, a, o: (snaps.append((time.perf_counter(), dict(acc))), None)[-1])
    for r in range(4):
        moe.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=33, eos_token_id=None, do_sample=False)
    res = collections.defaultdict(list)
    for (ta, a), (tb, b) in zip(snaps, snaps[1:]):
        if tb - ta > 0.2: continue
        res["step"].append(tb - ta)
        for k in b: res[k].append(b[k] - a.get(k, 0))
    out = {k: round(statistics.median(v) * 1e3, 3) for k, v in res.items()}
    out["attn_rest"] = round(out["self_attn"] - sum(v for k, v in out.items() if k.startswith("attn.")), 3)
    out["layer_rest"] = round(out["layer"] - out["self_attn"] - out["input_layernorm"] - out["post_attention_layernorm"] - out["mlp"], 3)
    out["mlp_rest"] = round(out["mlp"] - out["mlp.gate"] - out["mlp.experts"] - out["mlp.shared_experts"], 3)
    print(out)
