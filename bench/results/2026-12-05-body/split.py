import time, torch, statistics, sys
from pathlib import Path
from moeinf import MoE, OffloadConfig
from moeinf.bench.quant import speed_inputs
from transformers import LogitsProcessorList
import transformers.models.deepseek_v3.modeling_deepseek_v3 as M
torch.set_num_threads(1)
MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")
ids = speed_inputs(MODEL, 1)[0]
N = 32
OLD = sys.argv[1:] == ["old"]  # python split.py old | python split.py
acc = {}
def timed(f, key):
    acc[key] = 0.0
    def w(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[key] += time.perf_counter() - t; return r
    return w
class Rec:
    def __init__(s): s.t = []
    def __call__(s, i, sc): s.t.append((time.perf_counter(), dict(acc))); return sc
with MoE(MODEL, OffloadConfig(offload_dir=str(MODEL) + ".moeinf-int4", quant="int4", device_cache="100%")) as moe:
    m = moe.model
    m.forward = timed(m.forward, "fwd"); m.model.forward = timed(m.model.forward, "inner")
    m.lm_head.forward = timed(m.lm_head.forward, "head")
    m.model.embed_tokens.forward = timed(m.model.embed_tokens.forward, "embed")
    m.model.rotary_emb.forward = timed(m.model.rotary_emb.forward, "rotary")
    m.model.norm.forward = timed(m.model.norm.forward, "norm")
    M.create_causal_mask = timed(M.create_causal_mask, "mask")
    lw = []
    for l in m.model.layers:
        l.forward = timed(l.forward, "layer")
    m.model.layers[0].__call__  # noqa
    parts = {}
    for r in range(6):
        rec = Rec()
        if OLD:  # the clock as a logits processor, the length forced by min_new_tokens
            moe.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N,
                         do_sample=False, logits_processor=LogitsProcessorList([rec]))
        else:  # the clock as a forward hook, no end-of-sequence id
            h = m.register_forward_hook(lambda mod, a, o: rec(None, None))
            moe.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, eos_token_id=None,
                         do_sample=False)
            h.remove()
        if r == 0: continue
        for (ta, a), (tb, b) in zip(rec.t, rec.t[1:]):
            d = {k: b[k] - a[k] for k in acc}; d["step"] = tb - ta
            d["gen_loop"] = d["step"] - d["fwd"]; d["outer"] = d["fwd"] - d["inner"] - d["head"]
            d["inner_rest"] = d["inner"] - d["layer"] - d["embed"] - d["rotary"] - d["norm"] - d["mask"]
            for k, v in d.items(): parts.setdefault(k, []).append(v)
    print({k: round(statistics.median(v) * 1e3, 3) for k, v in parts.items()})
