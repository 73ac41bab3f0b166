"""Patches of one loaded model instance, declared as ordered lists per architecture.

A `Patch` names one replacement (of modules, or of a module's forward), when it applies (`applies`, read from
the build's facts: store quantised or exact, device, config) and what it does (`apply`). An architecture
declares the tuple of patches it takes (`moeinf.models.deepseek_v3.PATCHES`; every other one takes
`SHARED`), and the builder applies that tuple in its order (`moeinf.models.apply`). The order is part of the
declaration, stated where it matters: a patch that copies a weight runs before the one that replaces the
module holding it, and `forwards` patches run once every module is final (on its device, hooks bound).
Each patch checks the modules it replaces itself (their type and, for exact ones, their bits), so a patch
that meets no module of its form changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torch import nn

from ..config import OffloadConfig
from ..kernels.bf16_rows import replace_linears
from ..kernels.norms import replace_norms
from ..kernels.quant_linear import quantise_dense, resolve_kernel
from ..runtime import shared
from ..spec import ArchSpec
from ..store.quant import Quantization
from .attention_linears import replace_attention_linears
from .attention_linears import resolve as resolve_attention
from .gated_mlp import concat_gated_mlps
from .mla_expand import keep_expanded_kv

Phase = Literal["modules", "forwards"]


@dataclass
class Build:
    """What patches read: the config and the facts of this build. `row_linears` is what `BF16_LINEARS`
    did (a later patch reads it)."""

    config: OffloadConfig
    spec: ArchSpec
    quant: Quantization | None
    """The store's quantisation; None for an exact store."""
    row_kernel: bool
    """Exact one-row bf16 products in `moeinf.kernels.bf16_rows` (`bf16_row_kernel`, on CPU)."""
    row_linears: bool = False

    @property
    def exact(self) -> bool:
        return self.quant is None

    @property
    def on_cpu(self) -> bool:
        return self.config.device == "cpu"


@dataclass(frozen=True)
class Patch:
    name: str
    phase: Phase
    applies: Callable[[Build], bool]
    apply: Callable[[nn.Module, Build], object]


def _quantised_dense(model: nn.Module, build: Build) -> object:
    return quantise_dense(model, build.spec.shared_experts_module, build.quant, build.config.quant_dense,
                          resolve_kernel(build.config.quant_dense_kernel),
                          fuse=build.config.fast_dense_modules, activations=build.config.quant_activations)


def _gated_mlps(model: nn.Module, build: Build) -> object:
    return concat_gated_mlps(model, row_kernel=build.row_kernel)


def _norms(model: nn.Module, build: Build) -> object:
    return replace_norms(model, exact=build.exact)  # exact: torch's rms_norm sums as HF on CPU


def _attention_linears(model: nn.Module, build: Build) -> object:
    return replace_attention_linears(model, resolve_attention(build.config.attention_linears,
                                                              quantised=not build.exact))


def _expanded_kv(model: nn.Module, build: Build) -> object:
    return keep_expanded_kv(model, build.config.mla_expanded_max_bytes)


def _bf16_linears(model: nn.Module, build: Build) -> object:
    build.row_linears = bool(replace_linears(model))  # one-row bf16 products at memory speed, torch's bits
    return build.row_linears


def _early_shared(model: nn.Module, build: Build) -> object:
    return shared.install(model, build.spec.shared_experts_module)


def _fast(build: Build) -> bool:
    return build.config.fast_dense_modules


QUANTISED_DENSE = Patch("quantised dense linears", "modules", lambda b: not b.exact, _quantised_dense)
GATED_MLPS = Patch("gated MLPs' gate and up as one product", "modules",
                   lambda b: _fast(b) and b.exact and b.on_cpu, _gated_mlps)
NORMS = Patch("RMSNorms", "modules", lambda b: _fast(b) and (not b.exact or b.on_cpu), _norms)
ATTENTION_LINEARS = Patch("attention projections", "modules", lambda b: True, _attention_linears)
EXPANDED_KV = Patch("MLA's expanded keys and values kept", "modules",
                    lambda b: b.exact or not b.config.mla_absorb,  # absorbed decode steps expand nothing
                    _expanded_kv)
BF16_LINEARS = Patch("one-row bf16 linears", "modules", lambda b: b.exact and b.row_kernel, _bf16_linears)
EARLY_SHARED = Patch("shared experts computed while their block waits for a read", "forwards",
                     lambda b: b.config.early_shared_experts, _early_shared)

SHARED: tuple[Patch, ...] = (QUANTISED_DENSE, GATED_MLPS, NORMS, ATTENTION_LINEARS, EXPANDED_KV, BF16_LINEARS,
                             EARLY_SHARED)
"""The patches of every architecture without a list of its own, in order: `BF16_LINEARS` last of the
module patches, since it replaces whatever `nn.Linear` the others left; `EARLY_SHARED` wraps the final
shared-experts modules."""
