"""The e2e model (all in RAM, two threads) against unmodified HF: prefill and 16 greedy steps of two prompts,
logits compared bit for bit, with the bf16 kernel's calls counted inside and outside kernel steps.

    python bench/results/2026-12-07-bf16/exact_two_threads.py   # from the repository root
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from moeinf import MoE, OffloadConfig
from moeinf.runtime import bf16_rows, gemv

sys.path.insert(0, "tests")
from test_mla_decode import decode_logits  # noqa: E402

MODEL = "/work/bench-data/e2e-zoo-full-2048x768"
PROMPTS = ["The history of the city begins", "Scientists have found that the"]


class Counting:
    """The kernels module, its bf16 products counted by whether they ran in a kernel step."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def bf16_row_product(self, *args):
        self.calls.append(gemv.in_kernel_step())
        return self.inner.bf16_row_product(*args)


def main() -> None:
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    inputs = [tokenizer(p, return_tensors="pt").input_ids for p in PROMPTS]
    counting = bf16_rows._kernels = Counting(bf16_rows._kernels)
    with MoE(MODEL, OffloadConfig(offload_dir=MODEL + ".moeinf", device_cache="100%")) as moe:
        got = [decode_logits(moe.model, ids, None, steps=16) for ids in inputs]
    print("kernel calls in steps", counting.calls.count(True), "outside", counting.calls.count(False))
    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16).eval()
    for prompt, ids, (prefill, steps) in zip(PROMPTS, inputs, got, strict=True):
        want_prefill, want = decode_logits(hf, ids, None, steps=16)
        print(prompt[:20], "prefill equal", torch.equal(prefill, want_prefill),
              "steps equal", all(torch.equal(a, b) for a, b in zip(steps, want, strict=True)), len(want))


if __name__ == "__main__":
    main()
