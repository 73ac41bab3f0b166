import torch, time
from moeinf.runtime import gemv
from moeinf.store.quant import Quantization, quantise
torch.manual_seed(0); torch.set_num_threads(1)
def t(f, n=200):
    for _ in range(10): f()
    s = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-s)/n*1e6
for scheme, N, K in [("int8", 1536, 2048), ("int8", 2048, 768), ("int4", 1536, 2048), ("int4", 2048, 768), ("int4", 48, 64), ("int8", 7, 96)]:
    quant = Quantization.of(scheme) if scheme == "int8" else Quantization.of("int4", 32)
    w = torch.randn(N, K, dtype=torch.bfloat16)
    parts = quantise(w, quant)
    x = torch.randn(1, K, dtype=torch.bfloat16)
    f = (lambda q8: gemv.int8_gemv(x, parts["qweight"], parts["scales"], int8_activations=q8)) if scheme == "int8" else \
        (lambda q8: gemv.int4_gemv(x, parts["qweight"], parts["scales"], 32, int8_activations=q8))
    ref = f(False).float(); got = f(True).float()
    # reference with quantised activations in float64
    q, d = gemv.quantise_activations(x)
    xq = (q.double().reshape(1, -1, 32) * d.double().unsqueeze(-1)).reshape(1, K)
    ref_q = (gemv.int8_gemv if scheme == "int8" else (lambda a, b, c: gemv.int4_gemv(a, b, c, 32)))(xq.float(), parts["qweight"], parts["scales"]).double()
    print(scheme, N, K, "rel err vs float-x:", ((got - ref).norm() / ref.norm()).item(), "vs q-ref:", ((got.double() - ref_q).abs().max() / ref_q.abs().max()).item(),
          "us float", round(t(lambda: f(False))), "us q8", round(t(lambda: f(True))))
