import torch, time, statistics, sys
from moeinf.runtime import gemv
from moeinf.store.quant import Quantization, quantise
torch.manual_seed(0); torch.set_num_threads(1)
scheme = sys.argv[1]
quant = Quantization.of(scheme) if scheme == "int8" else Quantization.of("int4", 32)
experts = [(quantise(torch.randn(1536, 2048, dtype=torch.bfloat16), quant), quantise(torch.randn(2048, 768, dtype=torch.bfloat16), quant)) for e in range(32)]
x = torch.randn(1, 2048, dtype=torch.bfloat16)
f = (lambda x, p, q8: gemv.int8_gemv(x, p["qweight"], p["scales"], int8_activations=q8)) if scheme == "int8" else \
    (lambda x, p, q8: gemv.int4_gemv(x, p["qweight"], p["scales"], 32, int8_activations=q8))
def run(q8):
    t = time.perf_counter()
    for gu, dn in experts:
        h = f(x, gu, q8); f(h[:, :768].contiguous(), dn, q8)
    return (time.perf_counter() - t) / len(experts) * 1e3
ratios = []; fl = []; q = []
for rep in range(15):
    a = run(False); b = run(True); fl.append(a); q.append(b); ratios.append(b / a)
print(scheme, "float", round(statistics.median(fl), 3), "q8", round(statistics.median(q), 3), "ratio", round(statistics.median(ratios), 3))
