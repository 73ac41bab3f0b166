import time, torch, statistics
from moeinf.runtime import gemv
from moeinf import _kernels
from moeinf.store.quant import Quantization, quantise
torch.set_num_threads(1)
p = quantise(torch.randn(16, 64).bfloat16(), Quantization.of("int8"))
q, s = p["qweight"], p["scales"]
x = torch.randn(1, 64).bfloat16()
out = torch.empty(1, 16, dtype=torch.bfloat16)
def a(): return gemv.int8_gemv(x, q, s)
qp, sp, op, xp = q.data_ptr(), s.data_ptr(), out.data_ptr(), x.data_ptr()
bf = gemv.DTYPES[torch.bfloat16]
def b(): _kernels.int8_rowwise_gemv(xp, bf, 1, qp, sp, bf, op, 16, 64, None, False); return out
def c(): o = torch.empty(1, 16, dtype=torch.bfloat16); _kernels.int8_rowwise_gemv(x.data_ptr(), bf, 1, qp, sp, bf, o.data_ptr(), 16, 64, None, False); return o
for f in (a, b, c, a, b, c):
    ts = []
    for _ in range(2000):
        t = time.perf_counter_ns(); f(); ts.append(time.perf_counter_ns() - t)
    print(f.__name__, statistics.median(ts) / 1e3, "us")
