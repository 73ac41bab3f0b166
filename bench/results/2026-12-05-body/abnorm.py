import time, torch, statistics, sys
from pathlib import Path
from moeinf import MoE, OffloadConfig
from moeinf.bench.quant import speed_inputs
from moeinf.runtime.norms import TorchRMSNorm
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")
ids = speed_inputs(MODEL, 1)[0]
N = 32
with MoE(MODEL, OffloadConfig(offload_dir=str(MODEL) + ".moeinf", device_cache="100%")) as moe:
    m = moe.model
    fused = {n: mod for n, mod in m.named_modules() if type(mod) is TorchRMSNorm}
    hf = {}
    for n, mod in fused.items():
        h = DeepseekV3RMSNorm(mod.shape[0], eps=mod.eps); h.weight = mod.weight; hf[n] = h
    print(len(fused), "norms")
    def run(which):
        for n, mod in which.items(): m.set_submodule(n, mod)
        logits = []; t = []
        h = m.register_forward_hook(lambda mod, a, o: (t.append(time.perf_counter()), logits.append(o.logits[0, -1].clone()), None)[-1])
        moe.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, eos_token_id=None, do_sample=False)
        h.remove()
        return statistics.median([b - a for a, b in zip(t[1:], t[2:])]), logits
    run(fused); run(hf)
    res = {"hf": [], "fused": []}
    for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 8):
        a, la = run(hf); b, lb = run(fused)
        res["hf"].append(a); res["fused"].append(b)
        print("equal", all(torch.equal(x, y) for x, y in zip(la, lb)), end=" ", flush=True)
    print({k: round(statistics.median(v) * 1e3, 3) for k, v in res.items()})
    print(sorted(round(b / a, 3) for a, b in zip(res["hf"], res["fused"])))
