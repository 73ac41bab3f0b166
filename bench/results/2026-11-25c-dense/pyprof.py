"""cProfile of decode steps (direct forward loop, all in RAM, 1 thread): where the Python time goes."""
import sys, time, cProfile, pstats, torch, json
from moeinf import MoE, OffloadConfig
from transformers import DynamicCache
torch.set_num_threads(1)
M = "/work/bench-data/e2e-zoo-full-2048x768"
extra = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
moe = MoE(M, OffloadConfig(offload_dir=f"{M}.moeinf-{sys.argv[1]}", device_cache=1.0, eamc=f"{M}.eamc", **extra))
m = moe.model
ids = torch.randint(3, 8000, (1, 40), generator=torch.Generator().manual_seed(0))
def loop(n, prof=None):
    with torch.inference_mode():
        moe._runtime.offloader.start(1)
        cache = DynamicCache(config=m.config)
        out = m(ids, cache=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        if prof: prof.enable()
        for i in range(n):
            out = m(tok, cache=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1:].argmax(-1)
        if prof: prof.disable()
        moe._runtime.offloader.finish()
loop(8)
p = cProfile.Profile()
loop(20, p)
st = pstats.Stats(p); st.sort_stats(sys.argv[3] if len(sys.argv) > 3 else "tottime").print_stats(45)
moe.close()
