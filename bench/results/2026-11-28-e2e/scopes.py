"""Wall time and aten op count per module scope of a decode step, all experts resident (a diagnostic).

Decodes one held-out prompt on the e2e model's exact (or int8/int4) store at device_cache 100%, then
times --steps decode steps with forward hooks on each decoder layer's attention, norms, MoE block, router,
shared experts and offloaded experts, and counts the aten ops per scope over two more steps.

    T=1 python scopes.py none      # T: torch threads
"""
import argparse, json, time, collections
from pathlib import Path
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from moeinf import MoE, OffloadConfig
from moeinf.bench.e2e import heldout_texts
from moeinf.zoo.tokenizer import chat_text
from transformers import DynamicCache

MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")
ap = argparse.ArgumentParser()
ap.add_argument("quant", choices=["none", "int8", "int4"])
ap.add_argument("--config", default="{}")
ap.add_argument("--steps", type=int, default=16)
args = ap.parse_args()
import os; torch.set_num_threads(int(os.environ.get("T","1")))
store = MODEL.with_name(MODEL.name + (".moeinf" if args.quant == "none" else f".moeinf-{args.quant}"))
config = OffloadConfig.from_dict({"offload_dir": str(store), "quant": args.quant, "device_cache": "100%",
                                  "prefetch": "none", **json.loads(args.config)})
stack = ["top"]
counts = collections.Counter(); times = collections.Counter(); opnames = collections.defaultdict(collections.Counter)
class Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, a=(), kw=None):
        counts[stack[-1]] += 1; opnames[stack[-1]][str(func)] += 1
        return func(*a, **(kw or {}))
t0s = {}
def pre(name):
    def f(m, a, kw=None):
        stack.append(name); t0s[name] = time.perf_counter()
    return f
def post(name):
    def f(m, a, o, kw=None):
        times[name] += time.perf_counter() - t0s[name]; stack.pop()
    return f
with MoE(MODEL, config) as moe:
    ids = moe.tokenizer(chat_text(heldout_texts(1, 0)[0]), return_tensors="pt").input_ids
    model = moe.model
    for i, layer in enumerate(model.model.layers):
        for name, mod in [("attn", layer.self_attn), ("mlp", layer.mlp), ("norm", layer.input_layernorm), ("norm", layer.post_attention_layernorm)]:
            mod.register_forward_pre_hook(pre(name)); mod.register_forward_hook(post(name))
        for sub in ["experts", "gate", "shared_experts"]:
            if hasattr(layer.mlp, sub):
                m = getattr(layer.mlp, sub); m.register_forward_pre_hook(pre("mlp." + sub)); m.register_forward_hook(post("mlp." + sub))
    model.lm_head.register_forward_pre_hook(pre("lm_head")); model.lm_head.register_forward_hook(post("lm_head"))
    with torch.inference_mode():
        moe.generate(ids, max_new_tokens=8, do_sample=False)
        cache = DynamicCache(config=model.config)
        step = model(ids, past_key_values=cache, use_cache=True)
        token = step.logits[:, -1:].argmax(-1)
        for _ in range(4):
            step = model(token, past_key_values=cache, use_cache=True); token = step.logits[:, -1:].argmax(-1)
        times.clear()
        t = time.perf_counter()
        for _ in range(args.steps):
            step = model(token, past_key_values=cache, use_cache=True); token = step.logits[:, -1:].argmax(-1)
        total = (time.perf_counter() - t) / args.steps
        tt = dict(times)
        with Count():
            for _ in range(2):
                step = model(token, past_key_values=cache, use_cache=True); token = step.logits[:, -1:].argmax(-1)
print(f"{args.quant}: {total*1e3:.2f} ms/step")
for k, v in sorted(tt.items(), key=lambda kv: -kv[1]):
    print(f"  {k:22s} {v/args.steps*1e3:7.2f} ms (incl. children)  ops/step {counts[k]/2:6.0f}")
print(f"  {'top':22s} ops/step {counts['top']/2:6.0f}")
for k in opnames:
    print(k, opnames[k].most_common(12))
