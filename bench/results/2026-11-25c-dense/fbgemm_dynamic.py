"""fbgemm dynamic int8 (quantized::linear_dynamic) against _weight_int8pack_mm / int4pack at one row, the
attention, shared-expert and LM-head shapes of the 2048x768 model, 1 thread, weights rotated: median us."""
import time, statistics, warnings, torch
from moeinf.store.quant import Quantization, quantise
torch.set_num_threads(1)
def bench(fn, reps=300):
    for _ in range(20): fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6
warnings.simplefilter("ignore")
for N, K in ((128, 2048), (80, 2048), (192, 64), (2048, 128), (1536, 2048), (2048, 768), (8192, 2048)):
    copies = max(1, int(64e6 // (N * K)))
    ws = [torch.randn(N, K, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, K, dtype=torch.bfloat16)
    packs = []
    for w in ws:
        p = quantise(w, Quantization("int8", 0))
        qw = torch._make_per_channel_quantized_tensor(p["qweight"], p["scales"].double(), torch.zeros(N, dtype=torch.long), 0)
        packs.append(torch.ops.quantized.linear_prepack(qw, None))
    p8 = [quantise(w, Quantization("int8", 0)) for w in ws]
    i = iter(range(10**9))
    a = bench(lambda: torch.ops.quantized.linear_dynamic(x.float(), packs[next(i) % copies], False).to(torch.bfloat16))
    b = bench(lambda: torch.ops.aten._weight_int8pack_mm(x, p8[next(i) % copies]["qweight"], p8[next(i) % copies]["scales"]))
    print(f"{N}x{K}: fbgemm dyn (with casts) {a:7.1f} | int8pack {b:7.1f}", flush=True)
