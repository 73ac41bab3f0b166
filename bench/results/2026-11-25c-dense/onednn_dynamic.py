"""onednn::qlinear_pointwise (int8 weight prepacked from a plain int8 tensor, activations quantised per
row to uint8 here, tensor-scale overload) against fbgemm's linear_dynamic and _weight_int8pack_mm; one row,
1 thread, weights rotated out of cache: median us."""
import time, statistics, warnings, torch
from moeinf.store.quant import Quantization, quantise
torch.set_num_threads(1)
def bench(fn, reps=300):
    for _ in range(20): fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6
for N, K in ((128, 2048), (1536, 2048), (2048, 768), (8192, 2048)):
    copies = max(1, int(64e6 // (N * K)))
    ws = [torch.randn(N, K, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, K, dtype=torch.bfloat16)
    ps = [quantise(w, Quantization("int8", 0)) for w in ws]
    packed = [torch.ops.onednn.qlinear_prepack(p["qweight"], [1, K]) for p in ps]
    wsc = [p["scales"].float() for p in ps]
    zp = torch.zeros(N, dtype=torch.long)
    def one(i):
        xf = x.float()
        lo, hi = torch.aminmax(xf)
        s = ((hi - lo) / 255).clamp(min=1e-12)
        z = torch.round(-lo / s)
        q = torch.clamp(torch.round(xf / s) + z, 0, 255).to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise.tensor(q, s, z.to(torch.long), packed[i], wsc[i], zp, None,
                                                         1.0, 0, torch.bfloat16, "none", [], "")
    it = iter(range(10**9))
    a = bench(lambda: one(next(it) % copies))
    y = one(0); ref = x.float() @ ws[0].float().T
    print(f"{N}x{K}: onednn {a:7.1f} relerr {((y.float()-ref).norm()/ref.norm()).item():.4f}", flush=True)
