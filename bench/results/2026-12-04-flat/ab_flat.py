"""The flat decode layers (`moeinf.runtime.decode_layer`) against the layers' own forward in one process,
alternating round by round (all resident, two threads): logits bit-equal over 12 steps, then the step's
median ratio.

    T=2 python ab_flat.py .moeinf-int4 ROUNDS"""
import os, sys, time, statistics, torch
from pathlib import Path
from transformers import DynamicCache
from moeinf import MoE, OffloadConfig
from moeinf.bench.quant import speed_inputs
from moeinf.runtime import decode_layer
torch.set_num_threads(int(os.environ.get("T", "2")))
MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")
store, rounds = MODEL.with_name(MODEL.name + sys.argv[1]), int(sys.argv[2])
ids = speed_inputs(MODEL, 1)[0]
BIND = decode_layer.OneRowDecode._bind
def mode(on):
    decode_layer.OneRowDecode._bind = BIND if on else (lambda *a: None)
with MoE(MODEL, OffloadConfig(offload_dir=str(store), device_cache="100%")) as moe, torch.inference_mode():
    model = moe.model
    print(sum(decode_layer.flat_decode(m) is not None for m in model.modules()), "flat layers")
    def run(on, n=32, keep=False):
        mode(on)
        cache = DynamicCache(config=model.config)
        token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        outs = []
        t = time.perf_counter()
        for _ in range(n):
            logits = model(token, past_key_values=cache, use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
            if keep: outs.append(logits)
        return (time.perf_counter() - t) / n * 1e3, outs
    _, a = run(False, 12, True); _, b = run(True, 12, True)
    print("bit-equal logits over 12 steps:", all(torch.equal(x, y) for x, y in zip(a, b)))
    old, new, ratio = [], [], []
    for r in range(rounds):
        o, _ = run(False); n, _ = run(True)
        old.append(o); new.append(n); ratio.append(n / o)
    print("old %.2f new %.2f ms; new/old median %.3f  %s" % (statistics.median(old), statistics.median(new), statistics.median(ratio), [round(x, 3) for x in ratio]))
