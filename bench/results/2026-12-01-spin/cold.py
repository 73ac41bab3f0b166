import time, torch, statistics, sys
from moeinf.runtime import gemv
from moeinf.store.quant import Quantization, quantise
torch.manual_seed(0)
E = 40
q8 = Quantization.of("int8"); q4 = Quantization.of("int4", 32)
def mk(q):
    ws = []
    for e in range(E):
        a = quantise(torch.randn(1536, 2048).bfloat16(), q); b = quantise(torch.randn(2048, 768).bfloat16(), q)
        ws.append((a, b))
    return ws
w8 = mk(q8); w4 = mk(q4)
x1 = torch.randn(1, 2048).bfloat16(); x2 = torch.randn(1, 768).bfloat16()
def run8(rows):
    for a, b in w8:
        gemv.int8_gemv(x1, a["qweight"], a["scales"], int8_activations=rows); gemv.int8_gemv(x2, b["qweight"], b["scales"], int8_activations=rows)
def run4(rows):
    for a, b in w4:
        gemv.int4_gemv(x1, a["qweight"], a["scales"], 32, int8_activations=rows); gemv.int4_gemv(x2, b["qweight"], b["scales"], 32, int8_activations=rows)
b8 = sum(a["qweight"].nbytes + a["scales"].nbytes + b["qweight"].nbytes + b["scales"].nbytes for a, b in w8)
b4 = sum(a["qweight"].nbytes + a["scales"].nbytes + b["qweight"].nbytes + b["scales"].nbytes for a, b in w4)
big = torch.ones(200_000_000, dtype=torch.int8)
res = {}
for rnd in range(5):
    for th in (1, 2):
        torch.set_num_threads(th)
        for name, f, by in (("int8", lambda: run8(False), b8), ("int8q", lambda: run8(True), b8), ("int4q", lambda: run4(True), b4)):
            f()
            t = time.perf_counter(); f(); el = time.perf_counter() - t
            res.setdefault((name, th), []).append(by / el / 1e9)
        # raw read bandwidth: torch sum over 200 MB int8 (th threads)
        t = time.perf_counter(); big.sum(dtype=torch.int32); el = time.perf_counter() - t
        res.setdefault(("torch-sum", th), []).append(big.nbytes / el / 1e9)
for k, v in res.items(): print(k, "GB/s median %.1f" % statistics.median(v), [round(x, 1) for x in v])
print("bytes per expert int8 %.2f MB int4 %.2f MB" % (b8 / E / 1e6, b4 / E / 1e6))
