"""Per-module thread CPU time of decode steps (forward hooks on one instance), all in RAM, 1 thread."""
import sys, time, json, collections, torch
from moeinf import MoE, OffloadConfig
from transformers import DynamicCache
torch.set_num_threads(1)
M = "/work/bench-data/e2e-zoo-full-2048x768"
extra = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
moe = MoE(M, OffloadConfig(offload_dir=f"{M}.moeinf-{sys.argv[1]}", device_cache=1.0, eamc=f"{M}.eamc", **extra))
m = moe.model
acc = collections.defaultdict(float); on = [False]
def kind(name, mod):
    t = type(mod).__name__
    if name.endswith("self_attn"): return "attention (all)"
    if name.endswith("mlp"): return "MoE block (all)"
    if name.endswith("mlp.gate"): return "router"
    if name.endswith("shared_experts"): return "shared experts"
    if name.endswith("mlp.experts"): return "routed experts (runtime+kernels)"
    if "layernorm" in name or name.endswith("model.norm"): return "norms (incl. kv_a)"
    if name == "lm_head": return "lm head"
    if "self_attn." in name and t != "DeepseekV3RMSNorm": return "attention linears"
    return None
for name, mod in m.named_modules():
    k = kind(name, mod)
    if k is None: continue
    def pre(mod, args, k=k): mod._t0 = time.thread_time()
    def post(mod, args, out, k=k):
        if on[0]: acc[k] += time.thread_time() - mod._t0
    mod.register_forward_pre_hook(pre); mod.register_forward_hook(post)
ids = torch.randint(3, 8000, (1, 40), generator=torch.Generator().manual_seed(0))
def loop(n):
    with torch.inference_mode():
        moe._runtime.offloader.start(1)
        cache = DynamicCache(config=m.config)
        out = m(ids, cache=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        on[0] = True; c = time.thread_time()
        for i in range(n):
            out = m(tok, cache=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1:].argmax(-1)
        total = time.thread_time() - c; on[0] = False
        moe._runtime.offloader.finish()
    return total
loop(8); acc.clear()
n = 40; total = loop(n)
print(f"total {total / n * 1e3:.2f} ms CPU per token (with hooks)")
for k, v in sorted(acc.items(), key=lambda kv: -kv[1]): print(f"  {k:35s} {v / n * 1e3:6.2f}")
moe.close()
