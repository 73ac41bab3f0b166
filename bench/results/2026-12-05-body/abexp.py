import time, torch, statistics, sys
from pathlib import Path
from moeinf import MoE, OffloadConfig
from moeinf.bench.quant import speed_inputs
from moeinf.runtime.mla_expand import ExpandedKV
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")
ids = speed_inputs(MODEL, 1)[0]
N = 32
with MoE(MODEL, OffloadConfig(offload_dir=str(MODEL) + ".moeinf", device_cache="100%")) as moe:
    m = moe.model
    attns = [mod for mod in m.modules() if isinstance(mod.__dict__.get("expand_kv"), ExpandedKV)]
    memos = [a.__dict__["expand_kv"] for a in attns]
    print(len(attns), "memos", ids.shape)
    def run(kept):
        for a, memo in zip(attns, memos):
            if kept: a.expand_kv = memo
            else: a.__dict__.pop("expand_kv", None)
        logits = []; t = []
        h = m.register_forward_hook(lambda mod, a, o: (t.append(time.perf_counter()), logits.append(o.logits[0, -1].clone()), None)[-1])
        moe.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, eos_token_id=None, do_sample=False)
        h.remove()
        return statistics.median([b - a for a, b in zip(t[1:], t[2:])]), logits
    run(True); run(False)
    res = {"hf": [], "kept": []}
    for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 8):
        a, la = run(False); b, lb = run(True)
        res["hf"].append(a); res["kept"].append(b)
        print("equal", all(torch.equal(x, y) for x, y in zip(la, lb)), end=" ", flush=True)
    print({k: round(statistics.median(v) * 1e3, 3) for k, v in res.items()})
    print(sorted(round(b / a, 3) for a, b in zip(res["hf"], res["kept"])))
