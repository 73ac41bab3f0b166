import time, torch, statistics, sys
from pathlib import Path
from moeinf import MoE, OffloadConfig
from moeinf.bench.quant import speed_inputs
torch.set_num_threads(1)
MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")
quant = sys.argv[1] if len(sys.argv) > 1 else "int4"
store = {"int4": ".moeinf-int4", "int8": ".moeinf-int8", "none": ".moeinf"}[quant]
ids = speed_inputs(MODEL, 1)[0]
N = 32
with MoE(MODEL, OffloadConfig(offload_dir=str(MODEL) + store, quant=quant, device_cache="100%")) as moe:
    m = moe.model; body = m.model
    flat = body.__dict__["forward"]; print(type(flat).__name__)
    acc = [0.0]
    for l in body.layers:
        f = l.forward
        def w(*a, _f=f, **k):
            t0 = time.perf_counter(); r = _f(*a, **k); acc[0] += time.perf_counter() - t0; return r
        l.forward = w
    def run(use_flat):
        if use_flat: body.forward = flat
        else: del body.forward
        logits = []; t = []
        b0 = []; bt = []
        h1 = body.register_forward_pre_hook(lambda mod, a: (b0.append(time.perf_counter() - acc[0]), None)[-1])
        h2 = body.register_forward_hook(lambda mod, a, o: (bt.append(time.perf_counter() - acc[0] - b0[-1]), None)[-1])
        h = m.register_forward_hook(lambda mod, a, o: (t.append(time.perf_counter() - acc[0]), logits.append(o.logits[0, -1].clone()), None)[-1])
        moe.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, eos_token_id=None, do_sample=False)
        h.remove(); h1.remove(); h2.remove(); body.forward = flat
        return statistics.median(bt[1:]), logits
    run(True); run(False)
    res = {True: [], False: []}
    for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 8):
        for f in (False, True):
            ms, lg = run(f); res[f].append(ms)
            if f: print("equal", all(torch.equal(a, b) for a, b in zip(lg, base)), end=" ", flush=True)
            else: base = lg
    print({k: round(statistics.median(v) * 1e3, 3) for k, v in res.items()})
    print(sorted(round(b / a, 3) for a, b in zip(res[False], res[True])))
