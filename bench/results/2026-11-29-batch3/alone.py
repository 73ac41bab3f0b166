#!/usr/bin/env python
# usage: python alone.py MODEL_DIR PROMPTS NEW_TOKENS [float32]  (bf16 model: moeinf/zoo/weights/full; float32: its copy saved with save_pretrained)
"""A prompt's greedy answer alone (its own running batch) vs in a batch (joined with others), through moeinf's
running batch, and HF's plain model alone vs left-padded batch; first-step logits differences."""
import os, sys, torch, json
from pathlib import Path
from moeinf import OffloadConfig
from moeinf.batch.jobs import Prompt
from moeinf.batch.runner import run_continuous, pad_batch
from moeinf.serve.backend import SamplingParams
from moeinf.serve.loader import load_backend
from moeinf.hf.tokenizer import load_tokenizer
from moeinf.bench.e2e import heldout_texts
torch.set_num_threads(1)
model = Path(sys.argv[1]); n = int(sys.argv[2]); new = int(sys.argv[3]); dtype = sys.argv[4] if len(sys.argv) > 4 else "auto"
tok, _ = load_tokenizer(model)
texts = [t[:200] for t in heldout_texts(n, 0)]
prompts = [Prompt(i, t) for i, t in enumerate(texts)]
cfg = OffloadConfig(device_cache="25%", offload_dir=os.environ.get("STORE_ROOT", "/tmp") + f"/store-{model.name}")
params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
def run(bs, join=None):
    got = {}
    be = load_backend(model, cfg)
    try:
        run_continuous(be.open_batch, tok, prompts, bs, params, on_batch=lambda g, r: got.update({g[0].id: r[0]}), join=join)
    finally:
        be.close()
    return got
alone = run(1)
together = run(n)  # all join in one prefill pass
grouped = run(n, join=n // 4)  # joins of a quarter
def cmp(a, b):
    diff = [i for i in a if a[i] != b[i]]
    first = [next(k for k, (x, y) in enumerate(zip(a[i], b[i])) if x != y) for i in diff]
    return len(diff), first
print("alone vs one-pass batch: differing prompts, first differing position", cmp(alone, together))
print("alone vs quarter joins:", cmp(alone, grouped))
print("one-pass vs quarter joins:", cmp(together, grouped))
# HF plain: first-step logits alone vs padded batch
from transformers import AutoModelForCausalLM
hf = AutoModelForCausalLM.from_pretrained(model, dtype=(torch.bfloat16 if dtype in ("auto", "bfloat16") else torch.float32)).eval()
rows = [tok.encode(t) for t in texts]
with torch.inference_mode():
    ids, mask = pad_batch(rows, 0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    batch_logits = hf(ids, attention_mask=mask, position_ids=pos).logits[:, -1].float()
    worst, flips = 0.0, 0
    for i, r in enumerate(rows):
        one = hf(torch.tensor([r])).logits[0, -1].float()
        d = (one - batch_logits[i]).abs().max().item()
        worst = max(worst, d)
        flips += int(one.argmax() != batch_logits[i].argmax())
    print(f"HF first-step logits alone vs padded batch: max abs diff {worst:.3g}, argmax flips {flips}/{len(rows)}, bit-identical rows {sum(int(torch.equal(hf(torch.tensor([r])).logits[0,-1].float(), batch_logits[i])) for i, r in enumerate(rows))}/{len(rows)}")
