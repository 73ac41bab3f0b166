"""Decode step of the exact store against HF's model at a long context (the MLA expansion kept or not),
all experts resident, two threads: a 1000-token prompt, then 16 greedy tokens, three alternating rounds.

    python long_context.py"""
import statistics, time, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, DynamicCache
from moeinf import MoE, OffloadConfig
torch.set_num_threads(2)
MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")
ids = torch.randint(3, 8000, (1, 1000), generator=torch.Generator().manual_seed(0))
hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16).eval()
moe = MoE(MODEL, OffloadConfig(offload_dir=str(MODEL.with_name(MODEL.name + ".moeinf")), device_cache="100%"))
def decode(model, steps=16):
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:]
        token, tokens, t = out.argmax(-1), [], time.perf_counter()
        for _ in range(steps):
            out = model(token, past_key_values=cache, use_cache=True).logits[:, -1:]
            token = out.argmax(-1)
            tokens.append(int(token))
        return (time.perf_counter() - t) / steps * 1e3, tokens, out
res = {"hf": [], "moeinf": []}
for r in range(3):
    for name, model in (("hf", hf), ("moeinf", moe.model)) if r % 2 == 0 else (("moeinf", moe.model), ("hf", hf)):
        ms, tokens, logits = decode(model)
        res[name].append((ms, tokens, logits))
same = all(res["hf"][i][1] == res["moeinf"][i][1] and torch.equal(res["hf"][i][2], res["moeinf"][i][2]) for i in range(3))
print({k: [round(v[0], 1) for v in vs] for k, vs in res.items()}, "median ms", {k: round(statistics.median(v[0] for v in vs), 1) for k, vs in res.items()}, "tokens and last logits equal:", same)
moe.close()
