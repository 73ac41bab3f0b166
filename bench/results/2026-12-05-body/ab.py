"""Alternating A/B decodes of the exact e2e store, all resident: `python ab.py norms|expand|layers [threads] [pairs]`.

norms:  HF's RMSNorms against `TorchRMSNorm` (abnorm), swapped in place.
expand: HF's `expand_kv` against the kept MLA expansion (`ExpandedKV`).
layers: the decoder layers' own forward against the flat one (`ExactRowDecode`, ../2026-12-06-flat-exact).
Prints whether every step's logits were equal, the medians and the sorted per-pair ratios (B / A)."""
import statistics
import sys
import time
from pathlib import Path

import torch

from moeinf import MoE, OffloadConfig
from moeinf.bench.quant import speed_inputs
from moeinf.runtime.decode_exact import ExactRowDecode
from moeinf.runtime.mla_expand import ExpandedKV
from moeinf.runtime.norms import TorchRMSNorm

MODE = sys.argv[1]
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
PAIRS = int(sys.argv[3]) if len(sys.argv) > 3 else 10
MODEL = Path("/work/bench-data/e2e-zoo-full-2048x768")
ids = speed_inputs(MODEL, 1)[0]


def variants(model):
    """(name, apply) of A (the model's own) and B (moeinf's)."""
    if MODE == "norms":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
        fused = {n: m for n, m in model.named_modules() if type(m) is TorchRMSNorm}
        hf = {}
        for n, m in fused.items():
            hf[n] = DeepseekV3RMSNorm(m.shape[0], eps=m.eps)
            hf[n].weight = m.weight
        swap = lambda mods: [model.set_submodule(n, m) for n, m in mods.items()]  # noqa: E731
        return ("hf", lambda: swap(hf)), ("torch rms_norm", lambda: swap(fused))
    if MODE == "layers":
        return instance_toggle(model, "forward", ExactRowDecode, ("own forward", "flat"))
    return instance_toggle(model, "expand_kv", ExpandedKV, ("hf expand_kv", "kept expansion"))


def instance_toggle(model, attr, kind, names):
    """(name, apply) of the modules without and with the instance attribute `attr` of type `kind`."""
    modules = [m for m in model.modules() if isinstance(m.__dict__.get(attr), kind)]
    assert modules, f"no module has an instance {attr} of type {kind.__name__}"
    values = [m.__dict__[attr] for m in modules]

    def use(on):
        for module, value in zip(modules, values):
            if on:
                setattr(module, attr, value)
            else:
                module.__dict__.pop(attr, None)
    return (names[0], lambda: use(False)), (names[1], lambda: use(True))

with MoE(MODEL, OffloadConfig(offload_dir=str(MODEL) + ".moeinf", device_cache="100%")) as moe:
    model = moe.model
    (name_a, use_a), (name_b, use_b) = variants(model)

    def run(use):
        use()
        logits, t = [], []
        h = model.register_forward_hook(
            lambda mod, a, o: (t.append(time.perf_counter()), logits.append(o.logits[0, -1].clone()), None)[-1])
        moe.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, eos_token_id=None,
                     do_sample=False)
        h.remove()
        return statistics.median([b - a for a, b in zip(t[1:], t[2:])]), logits

    run(use_b), run(use_a)
    res = {name_a: [], name_b: []}
    for _ in range(PAIRS):
        a, la = run(use_a)
        b, lb = run(use_b)
        res[name_a].append(a)
        res[name_b].append(b)
        print("equal", all(torch.equal(x, y) for x, y in zip(la, lb)), end=" ", flush=True)
    print({k: round(statistics.median(v) * 1e3, 3) for k, v in res.items()})
    print(sorted(round(b / a, 3) for a, b in zip(res[name_a], res[name_b])))
