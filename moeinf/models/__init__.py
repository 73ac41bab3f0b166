"""Per-instance model patches: fast paths that replace modules or forwards of one loaded HF model.

Shared patches (any family whose modules have the form they check): `attention_linears.py` (the attention
projections' form), `gated_mlp.py` (gate and up as one product), `mla_expand.py` (MLA's expanded keys and
values kept between steps). One package per architecture for what only it has: `deepseek_v3/`.
"""
