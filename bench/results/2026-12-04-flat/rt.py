"""Where the exact store's decoded token goes at a cache share (one thread, the default prefetching):
thread-local exclusive wall time per token of the runtime's functions, the planner thread's apart ("[bg]"),
four prompts of 24 steps, medians over the last three.

    python rt.py 25%"""
import os, sys, time, collections, statistics, torch
from pathlib import Path
from transformers import DynamicCache
from moeinf import MoE, OffloadConfig
from moeinf.bench.quant import speed_inputs
from moeinf.runtime import offloader as O, cache as CA, compute as C, lookahead as L, tiers as T
torch.set_num_threads(1)
MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")
inputs = speed_inputs(MODEL, 4)
import threading
spent = collections.Counter(); tl = threading.local()
def timed(label, f):
    def w(*a, **k):
        stack = tl.__dict__.setdefault("s", [])
        main = threading.current_thread() is threading.main_thread()
        t = time.perf_counter_ns(); stack.append(0)
        try: return f(*a, **k)
        finally:
            e = time.perf_counter_ns() - t; inner = stack.pop(); spent[label if main else "[bg] " + label] += e - inner
            if stack: stack[-1] += e
    return w
for cls, names in ((O.Offloader, ["run_layer", "_plan", "_ahead", "_paced", "_record", "_summed_eam", "_context", "settle", "_compute", "_fill", "_held", "guess_next_pass"]),
                   (CA.ExpertCache, ["demand", "prefetch", "refresh", "_fetch_one", "_wait_landed", "_make_room"]),
                   (C.GatedKernel, ["__call__"]), (C.ExpertOutputs, ["result", "__init__"]), (C, ["Dispatch"]), (L.Lookahead, ["chances"]), (T.HostTier, ["wait", "submit", "cancel", "is_resident"])):
    for n in names:
        setattr(cls, n, timed(n, getattr(cls, n)))
cfg = dict(offload_dir=str(MODEL) + ".moeinf", device_cache=sys.argv[1], eamc=str(MODEL) + ".eamc")
with MoE(MODEL, OffloadConfig(**cfg)) as moe, torch.inference_mode():
    model = moe.model
    res = collections.defaultdict(list); steps = []
    for ids in inputs:
        moe._live().offloader.start(1)
        cache = DynamicCache(config=model.config)
        token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        spent.clear(); N = 24; t = time.perf_counter_ns()
        for _ in range(N):
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        steps.append((time.perf_counter_ns() - t) / N / 1e3)
        for k, v in spent.items(): res[k].append(v / N / 1e3)
    print("us/token", [round(s) for s in steps])
    for k, v in sorted(res.items(), key=lambda kv: -statistics.median(kv[1][1:])):
        print(f"{statistics.median(v[1:]):8.0f} us/token {k}")
    print(moe.stats()["stall_s"])
