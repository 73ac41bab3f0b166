import time, torch, statistics, sys
from moeinf.runtime import gemv
torch.manual_seed(0)
def bench(N, K, threads, n=400):
    torch.set_num_threads(threads)
    q = torch.randint(-127, 127, (N, K), dtype=torch.int8); s = torch.rand(N, dtype=torch.bfloat16)
    x = torch.randn(1, K, dtype=torch.bfloat16)
    for _ in range(20): gemv.int8_gemv(x, q, s)
    ts = []
    for _ in range(n):
        t = time.perf_counter(); gemv.int8_gemv(x, q, s); ts.append(time.perf_counter() - t)
        y = x * 2  # a small op between calls, as in a layer
    return statistics.median(ts) * 1e6
for N, K in ((128, 2048), (2048, 128), (1536, 2048), (8192, 2048)):
    print(N, K, "1t %.1f us" % bench(N, K, 1), "2t %.1f us" % bench(N, K, 2))
