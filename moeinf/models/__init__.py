"""Per-instance model patches: fast paths that replace modules or forwards of one loaded HF model.

Shared patches (any family whose modules have the form they check): `attention_linears.py` (the attention
projections' form), `gated_mlp.py` (gate and up as one product), `mla_expand.py` (MLA's expanded keys and
values kept between steps). One package per architecture for what only it has, with the ordered list of
patches it takes: `deepseek_v3/`. `patches.py` defines a patch and the list every other architecture
takes; `patches_for` picks the list, `apply` runs one phase of it.
"""

from __future__ import annotations

from torch import nn

from . import deepseek_v3
from .patches import SHARED, Build, Patch, Phase

ARCHITECTURES: dict[str, tuple[Patch, ...]] = {"deepseek_v3": deepseek_v3.PATCHES}
"""transformers `model_type` -> its patches; any other model type takes `SHARED`."""


def patches_for(model_type: str) -> tuple[Patch, ...]:
    return ARCHITECTURES.get(model_type, SHARED)


def apply(model: nn.Module, patches: tuple[Patch, ...], build: Build, phase: Phase) -> list[str]:
    """Apply the patches of `phase` that apply to this build, in order; the names of those applied."""
    applied = []
    for patch in patches:
        if patch.phase == phase and patch.applies(build):
            patch.apply(model, build)
            applied.append(patch.name)
    return applied


__all__ = ["ARCHITECTURES", "Build", "Patch", "apply", "patches_for"]
