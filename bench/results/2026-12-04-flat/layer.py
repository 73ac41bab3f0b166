"""Where a decoded token of a store goes, all experts resident, two threads: exclusive wall time per token of the
kernels module's calls ("C:") and of the runtime's functions, five rounds of 32 tokens, medians.

    python layer.py .moeinf-int4"""
import os, sys, time, collections, statistics, torch
from pathlib import Path
from transformers import DynamicCache
from moeinf import MoE, OffloadConfig
from moeinf.bench.quant import speed_inputs
from moeinf.runtime import gemv, decode_layer
from moeinf.runtime.offloader import Offloader
torch.set_num_threads(2)
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
K = decode_layer._kernels
names = [n for n in dir(K) if not n.startswith("_") and callable(getattr(K, n)) and not isinstance(getattr(K, n), type)]
wrapped = type("K", (), {n: staticmethod(timed("C:" + n, getattr(K, n))) for n in names} | {n: getattr(K, n) for n in dir(K) if not n.startswith("_") and n not in names})
decode_layer._kernels = wrapped; gemv._kernels = wrapped
Offloader.run_layer = timed("run_layer", Offloader.run_layer)
from moeinf.runtime import compute as C, cache as CA, quant_compute as Q, offloader as O
C.ExpertOutputs.__init__ = timed("EO.init", C.ExpertOutputs.__init__)
C.ExpertOutputs.result = timed("EO.result", C.ExpertOutputs.result)
C.ExpertOutputs._buffer = timed("EO.buffer", C.ExpertOutputs._buffer)
C.Dispatch.__init__ = timed("Dispatch", C.Dispatch.__init__)
CA.ExpertCache.take_resident = timed("take_resident", CA.ExpertCache.take_resident)
Q.QuantisedGatedKernel.rows_into = timed("rows_into", Q.QuantisedGatedKernel.rows_into)
gemv.gated_rows = timed("gemv.gated_rows", gemv.gated_rows)
O.Offloader._record = timed("_record", O.Offloader._record)
O.Offloader._resident_row = timed("_resident_row", O.Offloader._resident_row)
O.Offloader._steady = timed("_steady", O.Offloader._steady)
with MoE(MODEL, OffloadConfig(offload_dir=str(store), device_cache="100%")) as moe, torch.inference_mode():
    model = moe.model
    for layer in model.model.layers:
        f = decode_layer.flat_decode(layer)
        if f: f.decode = timed("flat", f.decode)
    model.lm_head.forward = timed("lm_head", model.lm_head.forward)
    cache = DynamicCache(config=model.config)
    token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    res = collections.defaultdict(list); steps = []
    for r in range(5):
        spent.clear(); N = 32; t = time.perf_counter_ns()
        for _ in range(N):
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        steps.append((time.perf_counter_ns() - t) / N / 1e3)
        for k, v in spent.items(): res[k].append(v / N / 1e3)
    print("us/token", [round(s) for s in steps])
    tot = 0
    for k, v in sorted(res.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"{statistics.median(v):8.0f} us/token {k}"); tot += statistics.median(v)
    print(f"{tot:8.0f} sum; rest {statistics.median(steps) - tot:.0f}")
