"""Offline: distinct experts a decode step of a batch touches, per layer, for batches in route-aware order
(first-layer signatures, moeinf.batch.grouping) vs arrival vs an oracle (signatures = the prompts' own decode
routing). The inflated e2e model routes as the zoo full model (zero-padded), so the small model's routing is
used (HF, all in RAM)."""
import sys, numpy as np, torch
from transformers import AutoModelForCausalLM
from moeinf.hf.tokenizer import load_tokenizer
from moeinf.bench.e2e import heldout_texts
from moeinf.batch.grouping import route_order, signatures
torch.set_num_threads(1)
src = 'moeinf/zoo/weights/full'
n, new = int(sys.argv[1]), int(sys.argv[2])
tok, _ = load_tokenizer(src)
hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
L, E = hf.config.num_hidden_layers, hf.config.n_routed_experts
texts = [t[:200] for t in heldout_texts(n, 0)]
captured = []
def hook(layer):
    def f(mod, args, out):
        idx = out[2] if isinstance(out, tuple) else out
        captured.append((layer, idx.detach().reshape(-1, idx.shape[-1]).clone()))
    return f
for i, layer in enumerate(hf.model.layers):
    layer.mlp.gate.register_forward_hook(hook(i))
prefill = np.zeros((n, L, E)); decode = np.zeros((n, new - 1, L, E), dtype=bool)
with torch.inference_mode():
    for p, t in enumerate(texts):
        ids = torch.tensor([tok.encode(t)])
        captured.clear()
        out = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        # the first L entries are the prefill pass, then one pass per decode step
        for k, (layer, idx) in enumerate(captured):
            step = k // L
            if step == 0:
                np.add.at(prefill[p, layer], idx.flatten().numpy(), 1)
            else:
                decode[p, step - 1, layer, idx.flatten().numpy()] = True
lengths = [len(tok.encode(t)) for t in texts]
for B in map(int, sys.argv[3].split(",")):
    def touched(order):
        per = []
        for s in range(0, n, B):
            rows = order[s:s + B]
            per.append(decode[rows].any(axis=0).sum(axis=-1).mean())  # union over rows, per step & layer
        return float(np.mean(per))
    first = prefill.copy(); first[:, 1:] = 0
    orders = {
        'arrival': list(range(n)),
        'length': sorted(range(n), key=lambda i: lengths[i]),
        'route (first layer of the prompt)': route_order(signatures(first), lengths, B),
        'prompt, all layers': route_order(signatures(prefill), lengths, B),
        'oracle (own decode routing)': route_order(signatures(decode.sum(axis=1).astype(float)), lengths, B),
    }
    for name, order in orders.items():
        print(f"{name:35s} distinct experts per layer per decode step of {B} rows: {touched(order):.2f} of {E}")
print("one row:", float(decode.sum(axis=-1).mean()))
