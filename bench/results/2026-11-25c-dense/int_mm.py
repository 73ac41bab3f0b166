"""torch._int_mm (int8 x int8 -> int32) at one row on the store's int8 [N, K] layout, and
quantized::int4mm_packed_weight_cpu; 1 thread, weights rotated out of cache: median us."""
import time, statistics, torch
from moeinf.store.quant import Quantization, quantise
torch.set_num_threads(1)
def bench(fn, reps=200):
    for _ in range(20): fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6
for N, K in ((1536, 2048), (2048, 768), (8192, 2048), (128, 2048)):
    copies = max(1, int(64e6 // (N * K)))
    ws = [torch.randn(N, K, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    ps = [quantise(w, Quantization("int8", 0)) for w in ws]
    x = torch.randn(1, K, dtype=torch.bfloat16)
    out = [f"{N}x{K}"]
    xq = torch.randint(-127, 127, (1, K), dtype=torch.int8)
    for M in (1, 17):
        xm = torch.randint(-127, 127, (M, K), dtype=torch.int8)
        try:
            i = iter(range(10**9))
            out.append(f"_int_mm M={M} (W.t view) {bench(lambda: torch._int_mm(xm, ps[next(i) % copies]['qweight'].t())):.1f}")
        except Exception as e:
            out.append(f"_int_mm M={M}: {str(e)[:80]}")
    def full():
        p = ps[next(j) % copies]
        xf = x.float()
        s = xf.abs().amax() / 127
        q = torch.round(xf / s).to(torch.int8)
        return (torch._int_mm(q.expand(1, K), p["qweight"].t()) * (s * p["scales"])).to(torch.bfloat16)
    j = iter(range(10**9))
    try:
        out.append(f"quantise x + _int_mm + rescale {bench(full):.1f}")
    except Exception as e:
        out.append(f"full: {str(e)[:80]}")
    i = iter(range(10**9))
    out.append(f"int8pack {bench(lambda: torch.ops.aten._weight_int8pack_mm(x, ps[next(i) % copies]['qweight'], ps[next(i) % copies]['scales'])):.1f}")
    print(" | ".join(out), flush=True)
