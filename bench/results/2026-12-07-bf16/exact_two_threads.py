"""The e2e model (all in RAM, two threads) against unmodified HF: prefill and 16 greedy steps of two prompts,
logits compared bit for bit, with the bf16 kernel counted inside and outside kernel steps."""
import sys, torch
sys.path.insert(0, "tests")  # run from the repository root
torch.set_num_threads(2)
from test_mla_decode import decode_logits
from transformers import AutoModelForCausalLM, AutoTokenizer
from moeinf import MoE, OffloadConfig
from moeinf.runtime import bf16_rows, gemv
md="/work/bench-data/e2e-zoo-full-2048x768"
tok=AutoTokenizer.from_pretrained(md)
prompts=["The history of the city begins","Scientists have found that the"]
calls=[]
real=bf16_rows._kernels
class Counting:
    def __getattr__(self, n): return getattr(real, n)
    def bf16_row_product(self,*a):
        calls.append(gemv.in_kernel_step()); return real.bf16_row_product(*a)
bf16_rows._kernels=Counting()
got=[]
with MoE(md, OffloadConfig(offload_dir=md+".moeinf", device_cache="100%")) as moe:
    for p in prompts:
        ids=tok(p, return_tensors="pt").input_ids
        got.append(decode_logits(moe.model, ids, None, steps=16))
print("kernel calls in steps", calls.count(True), "outside", calls.count(False))
hf=AutoModelForCausalLM.from_pretrained(md, dtype=torch.bfloat16).eval()
for p,(gp,gs) in zip(prompts,got):
    ids=tok(p, return_tensors="pt").input_ids
    wp,ws=decode_logits(hf, ids, None, steps=16)
    print(p[:20], "prefill equal", torch.equal(gp,wp), "steps equal", all(torch.equal(a,b) for a,b in zip(gs,ws)), len(ws))
