"""Writes the e2e model's look-ahead maps without the wrap (the A/B of wrapping past the last layer).

The wrapped maps (`lookahead_fit.fit(wrap=True)`, beside the EAMC) cut to what a non-wrapping fit has:
no map from the last layer, and at layer l only the depths that stay inside the pass (the output rows of
the same trained MLP; a fit with wrap=False would train them without the wrapped targets, a small
difference that this A/B of the *policy* ignores).

    python nowrap_maps.py   # -> /work/bench-data/e2e-zoo-full-2048x768.nowrap.lookahead.safetensors
"""
from pathlib import Path

from moeinf.trace import lookahead_fit

SRC = Path("/work/bench-data/e2e-zoo-full-2048x768.lookahead.safetensors")
DST = SRC.with_name("e2e-zoo-full-2048x768.nowrap.lookahead.safetensors")

maps = lookahead_fit.load(SRC)
layers, experts = int(maps.meta["num_layers"]), maps.num_experts
first, second = {}, {}
for layer in range(layers - 1):
    keep = min(maps.depth, layers - 1 - layer) * experts
    first[layer] = maps.first[layer]
    w2, b2 = maps.second[layer]
    second[layer] = (w2[:keep].clone(), b2[:keep].clone())
cut = lookahead_fit.LearnedMaps(first, second, dict(maps.meta, wraps=False))
lookahead_fit.save(cut, DST)  # the metadata, fingerprint included, is the wrapped file's
print(DST)
