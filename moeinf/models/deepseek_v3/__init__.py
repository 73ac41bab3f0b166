"""DeepSeek-V3's fast paths, and the ordered list of patches a DeepSeek-V3 model instance takes.

Its own modules: `router.py` (the group-free top-k router), `mla_decode.py` (a quantised store's MLA
decode step on the latent cache, `kv_b_proj` absorbed), `decode_layer.py` (a quantised store's decoder
layer at one decoded row as one flat function), `decode_exact.py` (an exact store's, of HF's own ops) and
`decode_body.py` (the body's one-row steps without the causal mask SDPA does not need).
"""

from __future__ import annotations

from torch import nn

from ...kernels.bf16_rows import RowLinear
from ..patches import (
    ATTENTION_LINEARS,
    BF16_LINEARS,
    EARLY_SHARED,
    EXPANDED_KV,
    GATED_MLPS,
    NORMS,
    QUANTISED_DENSE,
    Build,
    Patch,
)
from .decode_body import flatten_decode_body
from .decode_exact import flatten_exact_layers
from .decode_layer import flatten_decode_layers
from .mla_decode import absorb_mla
from .router import replace_routers


def _routers(model: nn.Module, build: Build) -> object:
    return replace_routers(model, one_row_kernel=not build.exact)


def _absorbed_mla(model: nn.Module, build: Build) -> object:
    return absorb_mla(model)


def _decode_layers(model: nn.Module, build: Build) -> object:
    return flatten_decode_layers(model)  # each layer binds its parts as they are at its first decoded row


def _exact_layers(model: nn.Module, build: Build) -> object:
    steps = build.row_linears and build.config.one_thread_steps  # torch at one thread inside a row's step
    flattened = flatten_exact_layers(model, kernel_step=steps)  # HF's ops, no module calls
    output = model.get_output_embeddings()
    if flattened and steps and isinstance(output, RowLinear):
        # between kernel steps a decoded row runs no torch op that opens an OpenMP region
        output.split_outside_step = True
    return flattened


def _decode_body(model: nn.Module, build: Build) -> object:
    return flatten_decode_body(model)


def _fast(build: Build) -> bool:
    return build.config.fast_dense_modules


ROUTERS = Patch("group-free top-k routers", "modules", _fast, _routers)
ABSORBED_MLA = Patch("MLA decode with kv_b_proj absorbed", "modules",
                     lambda b: not b.exact and b.config.mla_absorb, _absorbed_mla)
DECODE_LAYERS = Patch("quantised decoder layers as one flat function", "forwards",
                      lambda b: not b.exact and b.config.mla_absorb and _fast(b), _decode_layers)
EXACT_LAYERS = Patch("exact decoder layers as one flat function of HF's ops", "forwards",
                     lambda b: b.exact and _fast(b), _exact_layers)
EARLY_SHARED_UNLESS_FLAT = Patch(EARLY_SHARED.name, "forwards",
                                 lambda b: EARLY_SHARED.applies(b) and not DECODE_LAYERS.applies(b),
                                 EARLY_SHARED.apply)
DECODE_BODY = Patch("one-row body steps without the causal mask", "forwards", _fast, _decode_body)

PATCHES: tuple[Patch, ...] = (
    QUANTISED_DENSE,
    ROUTERS,
    GATED_MLPS,
    NORMS,
    ABSORBED_MLA,  # before ATTENTION_LINEARS: it copies kv_b_proj's exact weight
    ATTENTION_LINEARS,
    EXPANDED_KV,
    BF16_LINEARS,
    DECODE_LAYERS,  # the forwards bind the modules the patches above made
    EXACT_LAYERS,  # reads what BF16_LINEARS did
    EARLY_SHARED_UNLESS_FLAT,  # the quantised flat layers bind the shared experts' products themselves
    DECODE_BODY,
)
