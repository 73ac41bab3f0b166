import time, torch, statistics
import torch.nn.functional as F
W = [torch.randn(64, 2048) for _ in range(64)]
x = torch.randn(1, 2048).bfloat16()
for th in (1, 2, 1, 2):
    torch.set_num_threads(th)
    ts = []
    for i in range(2000):
        w = W[i % 64]
        t = time.perf_counter_ns(); F.linear(x.float(), w); ts.append(time.perf_counter_ns() - t)
    print(th, "threads: router linear %.1f us" % (statistics.median(ts) / 1e3))
