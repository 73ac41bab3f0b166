import sys, time, torch, statistics
from moeinf import MoE, OffloadConfig
torch.set_num_threads(int(sys.argv[2]))
M = "/work/bench-data/e2e-zoo-full-2048x768"
extra = eval(sys.argv[3]) if len(sys.argv) > 3 else {}
moe = MoE(M, OffloadConfig(offload_dir=f"{M}.moeinf-{sys.argv[1]}", device_cache=1.0, eamc=f"{M}.eamc", **extra))
m = moe.model
from transformers import DynamicCache
from torch.profiler import profile
ids = torch.randint(3, 8000, (1, 40))
def loop(n, prof=None):
    with torch.inference_mode():
        moe._runtime.offloader.start(1)
        cache = DynamicCache(config=m.config)
        out = m(ids, cache=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        ts = []
        if prof: prof.start()
        for i in range(n):
            t, c = time.perf_counter(), time.thread_time()
            out = m(tok, cache=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1:].argmax(-1)
            ts.append((time.perf_counter() - t, time.thread_time() - c))
        if prof: prof.stop()
        moe._runtime.offloader.finish()
    return statistics.median(t[0] for t in ts) * 1e3, statistics.median(t[1] for t in ts) * 1e3
loop(8)
print("forward loop median wall, thread-cpu ms", loop(32))
p = profile()
loop(20, p)
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
moe.close()
