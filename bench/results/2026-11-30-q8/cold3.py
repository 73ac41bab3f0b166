import torch, time, statistics, sys, os
from moeinf.runtime import gemv
from moeinf.store.quant import Quantization, quantise
torch.manual_seed(0); torch.set_num_threads(1)
quant = Quantization.of("int4", 32)
experts = [(quantise(torch.randn(1536, 2048, dtype=torch.bfloat16), quant), quantise(torch.randn(2048, 768, dtype=torch.bfloat16), quant)) for e in range(32)]
x = torch.randn(1, 2048, dtype=torch.bfloat16)
f = lambda x, p, q8: gemv.int4_gemv(x, p["qweight"], p["scales"], 32, int8_activations=q8)
def run(q8, env):
    os.environ["Q8S"] = env
    t = time.perf_counter()
    for gu, dn in experts:
        h = f(x, gu, q8); f(h[:, :768].contiguous(), dn, q8)
    return (time.perf_counter() - t) / len(experts) * 1e3
res = {}
variants = [(False, "0"), (True, "0"), (True, "1"), (True, "2")]
for rep in range(15):
    base = None
    for v in variants:
        t = run(*v); res.setdefault(v, []).append(t)
for v in variants: print(v, round(statistics.median(res[v]), 3), "ratio", round(statistics.median([a / b for a, b in zip(res[v], res[variants[0]])]), 3))
