"""Other int8/int4 CPU paths torch 2.13 ships, one row, 1 thread, weights rotated out of cache: median us."""
import time, statistics, torch
torch.set_num_threads(1)
def bench(fn, reps=200):
    for _ in range(20): fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6
for N, K in ((1536, 2048), (2048, 768), (8192, 2048)):
    copies = max(1, int(64e6 // (N * K)))
    ws = [torch.randn(N, K) * 0.02 for _ in range(copies)]
    x = torch.randn(1, K, dtype=torch.bfloat16)
    out = [f"{N}x{K}"]
    # fbgemm dynamic int8 (per-channel weight, activations quantised per tensor at run time)
    try:
        packs = []
        for w in ws:
            s = w.abs().amax(1) / 127
            qw = torch.quantize_per_channel(w, s.double(), torch.zeros(N, dtype=torch.long), 0, torch.qint8)
            packs.append(torch.ops.quantized.linear_prepack(qw, None))
        i = iter(range(10**9))
        out.append(f"fbgemm dyn int8 {bench(lambda: torch.ops.quantized.linear_dynamic(x.float(), packs[next(i) % copies], False)):.1f}")
        y = torch.ops.quantized.linear_dynamic(x.float(), packs[0], False)
        ref = x.float() @ ws[0].T
        out.append(f"relerr {((y-ref).norm()/ref.norm()).item():.4f}")
    except Exception as e:
        out.append(f"fbgemm: {type(e).__name__} {str(e)[:80]}")
    # _dyn_quant_matmul_4bit (KleidiAI on ARM; fallback elsewhere)
    try:
        g = 32
        packs = []
        for w in ws:
            wg = w.reshape(N, K // g, g)
            s = wg.abs().amax(-1) / 7
            q = torch.round(wg / s[..., None]).clamp(-8, 7).reshape(N, K).to(torch.int32)
            q = (q + 8).to(torch.uint8)
            q = (q[:, 1::2] << 4 | q[:, ::2]).contiguous()
            packs.append(torch.ops.aten._dyn_quant_pack_4bit_weight(q, s.to(torch.float32), None, g, K, N))
        i = iter(range(10**9))
        xf = x.float()
        out.append(f"dyn_quant_4bit {bench(lambda: torch.ops.aten._dyn_quant_matmul_4bit(xf, packs[next(i) % copies], g, K, N)):.1f}")
    except Exception as e:
        out.append(f"dyn4: {type(e).__name__} {str(e)[:100]}")
    print(" | ".join(out), flush=True)
# quantized::int4mm_packed_weight_cpu on the operands of _weight_int4pack_mm_for_cpu
from moeinf.store.quant import Quantization, quantise
for N, K in ((1536, 2048), (8192, 2048)):
    copies = max(1, int(64e6 // (N * K)))
    ps = [quantise(torch.randn(N, K, dtype=torch.bfloat16) * 0.02, Quantization("int4", 32)) for _ in range(copies)]
    x = torch.randn(1, K, dtype=torch.bfloat16)
    g = torch.tensor(32)
    i = iter(range(10**9))
    try:
        us = bench(lambda: torch.ops.quantized.int4mm_packed_weight_cpu(x, ps[next(i) % copies]["qweight"], g, ps[next(i) % copies]["scales"]))
        print(f"{N}x{K} int4mm_packed_weight_cpu {us:.1f}", flush=True)
    except Exception as e:
        print(f"{N}x{K} int4mm_packed_weight_cpu: {type(e).__name__} {str(e)[:120]}", flush=True)
