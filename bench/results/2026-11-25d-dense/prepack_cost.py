"""What fbgemm's int8 prepack costs per expert matrix, and what parts of it: building the per-channel
quantised tensor, linear_prepack itself; against one linear_dynamic call (1 thread, one row)."""
import time, statistics, warnings, torch
from moeinf.store.quant import Quantization, quantise
torch.set_num_threads(1)
warnings.simplefilter("ignore")
def t(fn, reps=20):
    fn(); ts = []
    for _ in range(reps):
        s = time.perf_counter(); fn(); ts.append(time.perf_counter() - s)
    return statistics.median(ts) * 1e3
for N, K in ((1536, 2048), (2048, 768)):
    w = torch.randn(N, K, dtype=torch.bfloat16) * 0.02
    p = quantise(w, Quantization("int8", 0))
    zeros = torch.zeros(N, dtype=torch.long)
    sd = p["scales"].double()
    mk = lambda: torch._make_per_channel_quantized_tensor(p["qweight"], sd, zeros, 0)
    qw = mk()
    a = t(mk)
    b = t(lambda: torch.ops.quantized.linear_prepack(qw, None))
    fp = torch.ops.quantized.linear_prepack(qw, None)
    x = torch.randn(1, K)
    c = t(lambda: torch.ops.quantized.linear_dynamic(x, fp, False), 200)
    print(f"{N}x{K}: make qtensor {a:.3f} ms, linear_prepack {b:.3f} ms, linear_dynamic {c*1e3:.1f} us", flush=True)
