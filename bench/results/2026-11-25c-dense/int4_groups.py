"""int4/int8 weight-only kernels at one row, 1 thread, across group sizes: median us, GB/s of weight bytes."""
import sys, time, statistics, torch
from moeinf.store.quant import Quantization, quantise
torch.set_num_threads(1)
shapes = {"gate_up 1536x2048": (1536, 2048), "down 2048x768": (2048, 768), "lm_head 8192x2048": (8192, 2048),
          "q_proj 128x2048": (128, 2048)}
def bench(fn, reps=200):
    for _ in range(20): fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6
# several copies so weights come from DRAM, not cache (rotate)
for label, (N, K) in shapes.items():
    w = torch.randn(N, K, dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, K, dtype=torch.bfloat16)
    copies = max(1, int(64e6 // (N * K)))
    row = [label]
    for g in (32, 64, 128, 256):
        if K % g: row.append("-"); continue
        q = Quantization("int4", g)
        ps = [quantise(w + 0.001 * i, q) for i in range(copies)]
        it = iter(range(10**9))
        def f():
            p = ps[next(it) % copies]
            torch.ops.aten._weight_int4pack_mm_for_cpu(x, p["qweight"], g, p["scales"])
        us = bench(f)
        nbytes = ps[0]["qweight"].numel() + ps[0]["scales"].numel() * 2
        row.append(f"g{g} {us:7.1f}us {nbytes/us/1e3:5.1f}GB/s")
    q = Quantization("int8", 0)
    ps = [quantise(w + 0.001 * i, q) for i in range(copies)]
    it = iter(range(10**9))
    def f8():
        p = ps[next(it) % copies]
        torch.ops.aten._weight_int8pack_mm(x, p["qweight"], p["scales"])
    us = bench(f8); nbytes = N * K + N * 2
    row.append(f"int8 {us:7.1f}us {nbytes/us/1e3:5.1f}GB/s")
    print(" | ".join(row), flush=True)
