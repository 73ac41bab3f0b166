"""Offline: how well are the next token's MoE layer 0/1/2 experts named from its embedding alone?

For every decode step of 12 held-out prompts x 32 tokens on the e2e model (all in RAM, HF), compares the
experts the step's token actually routed to in layers 0, 1, 2 with: the first layer's router on the
token's normed embedding (layer 0: the existing guess table; layers 1, 2: that layer's own router on the
same embedding), the learned look-ahead maps of layer 0 run on that embedding and its guessed routing
(depths 1, 2), and the previous token's experts. Prints slot recall (top-k against the k routed).

    python guess_layers.py
"""
import torch, collections, sys
from transformers import AutoModelForCausalLM
from moeinf.bench.e2e import heldout_texts
from moeinf.bench.replay_routing import zoo_prompt_ids
from moeinf.hf.tokenizer import load_tokenizer
from moeinf.trace.lookahead_fit import load as load_maps
M = "/work/bench-data/e2e-zoo-full-2048x768"
torch.set_num_threads(2)
model = AutoModelForCausalLM.from_pretrained(M, dtype=torch.bfloat16).eval()
tok, _ = load_tokenizer(M)
maps = load_maps("/work/bench-data/e2e-zoo-full-2048x768.lookahead.safetensors")
layers = model.model.layers
routed = {}
inputs = {}
for i, l in enumerate(layers):
    def hook(m, a, o, i=i):
        routed.setdefault(i, []).append(o[2].clone()); inputs.setdefault(i, []).append(a[0].clone())
    l.mlp.gate.register_forward_hook(hook)
E = model.config.n_routed_experts; k = model.config.num_experts_per_tok
emb = model.get_input_embeddings().weight
with torch.no_grad():
    normed = layers[0].post_attention_layernorm(emb)  # [V, H]
    _, _, g0 = layers[0].mlp.gate(normed)  # [V, k] the existing guess table
    ch = maps.chances(0, normed.float() if False else normed, g0)  # [D, V, E]
    g_learned = {d: ch[d - 1].topk(k, dim=-1).indices for d in (1, 2)}
    g_router = {d: layers[d].mlp.gate(normed)[2] for d in (1, 2)}
texts = heldout_texts(12, 1)
hits = collections.Counter(); total = collections.Counter()
for text in texts:
    routed.clear(); inputs.clear()
    ids = torch.tensor([zoo_prompt_ids(tok, text, 256)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=32, do_sample=False)
    new = out[0, ids.shape[1]:]
    # decode passes: routed[l][p] for p>=1 are single-token passes; pass p's input token is new[p-1]
    for p in range(1, len(routed[0])):
        t = int(new[p - 1])
        for d in (0, 1, 2):
            actual = set(routed[d][p][-1].tolist())
            cands = {"table/router": set((g0[t] if d == 0 else g_router[d][t]).tolist())}
            if d: cands["learned"] = set(g_learned[d][t].tolist())
            cands["prev-token"] = set(routed[d][p - 1][-1].tolist())
            for name, c in cands.items():
                hits[(d, name)] += len(actual & c); total[(d, name)] += k
for key in sorted(hits):
    print(key, round(hits[key] / total[key], 3))
