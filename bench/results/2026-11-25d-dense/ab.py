"""A/B: several OffloadConfig variants of one store in one process, all in RAM, interleaved rounds; median
decode-step wall and thread CPU ms of the direct forward loop (no generate)."""
import sys, time, torch, statistics, json
from moeinf import MoE, OffloadConfig
from transformers import DynamicCache
torch.set_num_threads(int(sys.argv[2]))
M = "/work/bench-data/e2e-zoo-full-2048x768"
variants = json.loads(sys.argv[3])
setup = sys.argv[4] if len(sys.argv) > 4 else ""
moes = {}
for name, extra in variants.items():
    moes[name] = MoE(M, OffloadConfig(offload_dir=f"{M}.moeinf" if sys.argv[1] == "exact" else f"{M}.moeinf-{sys.argv[1]}", device_cache=1.0, eamc=f"{M}.eamc", **extra))
    if setup: exec(setup, {"moe": moes[name], "name": name, "torch": torch})
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 8000, (1, int(n)), generator=g) for n in (40, 23, 57, 31)]
def loop(moe, ids, n):
    m = moe.model
    with torch.inference_mode():
        moe._runtime.offloader.start(1)
        cache = DynamicCache(config=m.config)
        out = m(ids, cache=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1); toks = [tok.item()]
        ts = []
        for i in range(n):
            t, c = time.perf_counter(), time.thread_time()
            out = m(tok, cache=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1:].argmax(-1); toks.append(tok.item())
            ts.append((time.perf_counter() - t, time.thread_time() - c))
        moe._runtime.offloader.finish()
    return ts, toks
t0 = time.perf_counter()
for name, moe in moes.items():
    for p in prompts: loop(moe, p, 4)
print("warm-up s", round(time.perf_counter() - t0, 1), flush=True)
res = {n: [] for n in moes}; toks = {n: [] for n in moes}
for r in range(int(sys.argv[5]) if len(sys.argv) > 5 else 3):
    for p in prompts:
        for name, moe in moes.items():
            ts, tk = loop(moe, p, 24); res[name] += ts; toks[name].append(tk)
base = next(iter(moes))
for name in moes:
    w = statistics.median(t[0] for t in res[name]) * 1e3; c = statistics.median(t[1] for t in res[name]) * 1e3
    same = sum(a == b for x, y in zip(toks[name], toks[base]) for a, b in zip(x, y)) / sum(len(x) for x in toks[base])
    print(f"{name:12s} wall {w:6.2f} ms  cpu {c:6.2f} ms  tokens same as {base}: {same:.0%}")
for moe in moes.values(): moe.close()
