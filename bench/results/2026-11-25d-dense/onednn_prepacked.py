"""onednn's prepacked int8 linear (qlinear_prepack once, then qlinear_pointwise on a row quantised to
uint8 by hand) against fbgemm's linear_dynamic and the current _int_mm row kernel, expert shapes, one row,
1 thread, weights rotated over ~64 MB so they come from DRAM: median us; and each prepack's cost in ms."""
import time, statistics, warnings, torch
from moeinf.store.quant import Quantization, quantise
from moeinf.runtime.quant_compute import dynamic_int8_row
torch.set_num_threads(1)
warnings.simplefilter("ignore")
def bench(fn, reps=300):
    for _ in range(20): fn()
    ts = []
    for _ in range(reps):
        s = time.perf_counter(); fn(); ts.append(time.perf_counter() - s)
    return statistics.median(ts) * 1e6
for N, K in ((1536, 2048), (2048, 768)):
    copies = max(1, int(64e6 // (N * K)))
    parts = [quantise(torch.randn(N, K, dtype=torch.bfloat16) * 0.02, Quantization("int8", 0)) for _ in range(copies)]
    x = torch.randn(1, K, dtype=torch.bfloat16)
    s = time.perf_counter()
    packs = [torch.ops.onednn.qlinear_prepack(p["qweight"], [1, K]) for p in parts]
    one = (time.perf_counter() - s) / copies * 1e3
    wz = torch.zeros(N, dtype=torch.long)
    wsf = [p["scales"].float() for p in parts]
    i = iter(range(10**9))
    def onednn():
        j = next(i) % copies
        xf = x.float()
        lo, hi = xf.min().clamp(max=0), xf.max().clamp(min=0)
        scale = float((hi - lo) / 255) or 1.0
        zp = int(torch.round(-lo / scale))
        qx = torch.clamp(torch.round(xf / scale) + zp, 0, 255).to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise(qx, scale, zp, packs[j], wsf[j], wz, None, 1.0, 0, torch.float32, "none", [], "")
    a = bench(onednn)
    b = bench(lambda: dynamic_int8_row(x, parts[next(i) % copies]["qweight"], parts[next(i) % copies]["scales"]))
    print(f"{N}x{K}: onednn prepacked {a:.1f} us (prepack {one:.2f} ms) | _int_mm row {b:.1f} us", flush=True)
