import time, torch, statistics, sys
from moeinf.runtime import gemv
from moeinf.store.quant import Quantization, quantise
torch.manual_seed(0)
E = 40
q4 = Quantization.of("int4", 32)
w4 = [(quantise(torch.randn(1536, 2048).bfloat16(), q4), quantise(torch.randn(2048, 768).bfloat16(), q4)) for e in range(E)]
x1 = torch.randn(1, 2048).bfloat16(); x2 = torch.randn(1, 768).bfloat16()
b4 = sum(a["qweight"].nbytes + a["scales"].nbytes + b["qweight"].nbytes + b["scales"].nbytes for a, b in w4)
rp = [(gemv.RowProduct(a["qweight"], a["scales"], 32, int8_activations=True), gemv.RowProduct(b["qweight"], b["scales"], 32, int8_activations=True)) for a, b in w4]
for th in (1, 2):
    torch.set_num_threads(th)
    v = []
    for r in range(9):
        t = time.perf_counter()
        for a, b in rp: a(x1); b(x2)
        v.append(b4 / (time.perf_counter() - t) / 1e9)
    print(sys.argv[1], th, "threads int4q GB/s %.1f" % statistics.median(v[1:]))
