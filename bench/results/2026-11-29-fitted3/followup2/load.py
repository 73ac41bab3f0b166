"""Scratch: cache the workloads as pickles."""
import pickle, sys, time
from moeinf.bench.cache import load_workload
S = "$SHARED/data/traces/"
for name, path, top1 in [("dsv2top1", S + "dsv2lite-puffin-700.jsonl.gz", True),
                         ("gpttop1", S + "gptoss20b-fingerprint-400.jsonl.gz", True),
                         ("gpt", S + "gptoss20b-fingerprint-400.jsonl.gz", False)]:
    t = time.time()
    wl = load_workload(path, quick=False, seed=0, top1=top1)
    pickle.dump(wl, open(f"$WORK/{name}.pkl", "wb"))
    print(name, len(wl.traces), wl.num_layers, wl.num_experts, round(time.time() - t, 1), flush=True)
