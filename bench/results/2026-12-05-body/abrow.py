# Run at 0c07f02 (Offloader._row_into, reverted in 3b309ac): `python abrow.py 50% 6`.
"""Rows whose layer plans beside compute: ungrouped (Offloader._row_into) vs grouped, alternating."""
import time, torch, statistics, sys
from pathlib import Path
from moeinf import MoE, OffloadConfig
from moeinf.runtime.offloader import Offloader
from moeinf.bench.quant import speed_inputs
torch.set_num_threads(1)
MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")
inputs = speed_inputs(MODEL, 3)
N = 24
cache = sys.argv[1] if len(sys.argv) > 1 else "50%"
own = Offloader._row_into
calls = [0]
def counted(self, *a):
    out = own(self, *a); calls[0] += out is not None; return out
with MoE(MODEL, OffloadConfig(offload_dir=str(MODEL) + ".moeinf", device_cache=cache,
                              eamc=str(MODEL) + ".eamc")) as moe:
    m = moe.model
    def run(ungrouped):
        Offloader._row_into = counted if ungrouped else (lambda self, *a: None)
        times = []
        for ids in inputs:
            t = []
            h = m.register_forward_hook(lambda mod, a, o: (t.append(time.perf_counter()), None)[-1])
            moe.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, eos_token_id=None, do_sample=False)
            h.remove()
            times += [b - a for a, b in zip(t[1:], t[2:])]
        return statistics.median(times)
    run(True); run(False)
    res = {"grouped": [], "ungrouped": []}
    for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 6):
        res["grouped"].append(run(False)); res["ungrouped"].append(run(True))
    print(cache, {k: round(statistics.median(v) * 1e3, 2) for k, v in res.items()}, "ungrouped calls", calls[0])
    print(sorted(round(b / a, 3) for a, b in zip(res["grouped"], res["ungrouped"])))
