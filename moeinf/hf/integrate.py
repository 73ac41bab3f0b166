"""Per-instance replacement of a model's experts modules, driven by the spec table.

The MoE blocks stay the unmodified transformers modules: their routers run as written and call
`self.experts(hidden_states, top_k_index, top_k_weights)`. Only the experts module of each block, found by
`spec.experts_module` over `named_modules()`, is swapped on this model instance for a module built by the
caller (the offloaded experts of `moeinf/runtime/`). Nothing is patched globally.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..kernels.moe import DenseActDenseKernel, ExpertKernel, GatedKernel
from ..spec import ArchSpec
from .adapters import ADAPTERS


@dataclass(frozen=True)
class ExpertsSite:
    """One experts module of the model: its MoE-layer ordinal, dotted name and the original module."""

    layer: int
    name: str
    module: nn.Module


def experts_sites(model: nn.Module, spec: ArchSpec) -> list[ExpertsSite]:
    """The experts modules in `named_modules()` order; their position is the MoE-layer ordinal of the keys."""
    pattern = re.compile(spec.experts_module)
    sites: list[ExpertsSite] = []
    for name, module in model.named_modules():
        if pattern.fullmatch(name):
            sites.append(ExpertsSite(len(sites), name, module))
    if not sites:
        raise ValueError(
            f"no module of this {type(model).__name__} matches experts_module={spec.experts_module!r} "
            f"(family {spec.family!r}); fix the ArchSpec in moeinf/spec.py"
        )
    return sites


def kernel_for(module: nn.Module, spec: ArchSpec) -> ExpertKernel:
    """The exact compute of one expert of `module`, with the flags and gate the module declares."""
    if spec.adapter == "switch":
        first = module[next(iter(module.keys()))]
        return DenseActDenseKernel(act=first.act)
    if spec.adapter in ADAPTERS:
        return ADAPTERS[spec.adapter].kernel(module)
    for flag in ("has_gate", "has_bias", "is_transposed"):
        if not hasattr(module, flag):
            raise ValueError(
                f"{type(module).__name__} does not declare {flag!r}: it is not an experts-interface module "
                "(transformers' @use_experts_implementation); "
                f"set adapter in moeinf/spec.py for {spec.family!r}"
            )
    post_norm = module.post_expert_norm if getattr(module, "has_post_expert_norm", False) else None
    return GatedKernel(
        has_gate=module.has_gate,
        has_bias=module.has_bias,
        is_transposed=module.is_transposed,
        apply_gate=module._apply_gate if module.has_gate else None,
        act=getattr(module, "act_fn", None),
        post_norm=post_norm,
    )


def replace_experts(model: nn.Module, spec: ArchSpec,
                    make: Callable[[ExpertsSite, ExpertKernel], nn.Module]) -> list[ExpertsSite]:
    """Swap every experts module of `model` (this instance only) for `make(site, kernel)`.

    The original module's expert tensors are dropped with it; a post-expert norm (dense weights) is kept
    as the child `post_expert_norm` of the new module so its state-dict key is unchanged.
    """
    sites = experts_sites(model, spec)
    for site in sites:
        kernel = kernel_for(site.module, spec)
        new = make(site, kernel)
        if isinstance(kernel, GatedKernel) and kernel.post_norm is not None:
            new.post_expert_norm = site.module.post_expert_norm
        adapter = ADAPTERS.get(spec.adapter)
        if adapter is not None and adapter.block is not None and adapter.parent:
            parent = site.name.rpartition(".")[0]  # the MoE block around the experts
            model.set_submodule(parent, adapter.block(model.get_submodule(parent), new))
        elif adapter is not None and adapter.block is not None:
            model.set_submodule(site.name, adapter.block(site.module, new))
        else:
            model.set_submodule(site.name, new)
    return sites

