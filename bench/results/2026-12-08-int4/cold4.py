import sys, time, torch, statistics
from moeinf.store.quant import quantise, Quantization
from moeinf.runtime import gemv
torch.manual_seed(0)
scheme = sys.argv[1]; threads = int(sys.argv[2]); E = int(sys.argv[3]) if len(sys.argv) > 3 else 96
torch.set_num_threads(threads)
q = Quantization.of(scheme)
group = q.group_size if scheme == "int4" else 0
ex = []
for e in range(E):
    gu = quantise(torch.randn(1536, 2048, dtype=torch.bfloat16) * 0.02, q)
    dn = quantise(torch.randn(2048, 768, dtype=torch.bfloat16) * 0.02, q)
    ex.append((gemv.RowProduct(gu["qweight"], gu["scales"], group, int8_activations=(scheme == "int4")),
               gemv.RowProduct(dn["qweight"], dn["scales"], group, int8_activations=(scheme == "int4"))))
nbytes = sum(t.numel() * t.element_size() for g, d in ex[:1] for t in (g.qweight, g.scales, d.qweight, d.scales))
x = torch.randn(1, 2048, dtype=torch.bfloat16)
out = torch.empty(2, 2048, dtype=torch.bfloat16)
w = torch.tensor([0.5, 0.5], dtype=torch.bfloat16)
def one(i, j):
    gemv.gated_rows(x, [(ex[i][0], ex[i][1], 0), (ex[j][0], ex[j][1], 1)], w, out)
res = {}
for mode in ["cold", "hot"] * 3:
    ts = []
    for i in range(0, E - 1, 2):
        a, b = (i, i + 1) if mode == "cold" else (0, 1)
        t = time.perf_counter(); one(a, b); ts.append(time.perf_counter() - t)
    res.setdefault(mode, []).append(statistics.median(ts))
for k, v in res.items():
    m = statistics.median(v)
    print(scheme, threads, k, f"{m*1e6:.0f} us per 2 experts, {2*nbytes/m/1e9:.1f} GB/s, expert {nbytes/1e6:.2f} MB")
