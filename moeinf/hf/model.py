"""Build a transformers model whose experts are never materialised (gpt-fast style load path).

1. The skeleton is built from `config.json` on the meta device: no parameter memory at all.
2. Every experts module is replaced on this instance (`moeinf.hf.integrate.replace_experts`).
3. Dense weights are assigned from the store's tensors (`load_state_dict(assign=True)`): each dense tensor
   exists once, and expert tensors never exist in RAM except in the runtime's slots.
4. Non-persistent buffers the meta device left empty (rotary `inv_freq`...) are recomputed on the CPU by
   instantiating their owning module again from its config; tied weights are tied as the config says.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from ..kernels.moe import ExpertKernel
from ..spec import ArchSpec
from .integrate import ExpertsSite, replace_experts

log = logging.getLogger(__name__)


def cache_keyword(model: nn.Module) -> str:
    """The keyword `model.forward` takes its KV cache by, and the name of its output's cache: `cache`
    from transformers 5.24 (which deprecates `past_key_values` with a warning on every call), else
    `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def resolve_dtype(config: object, dtype: str) -> torch.dtype:
    """`dtype` of OffloadConfig ("auto" = the checkpoint's dtype, float32 when it states none)."""
    if dtype != "auto":
        return getattr(torch, dtype)
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, torch.dtype):
        return declared
    if isinstance(declared, str):
        return getattr(torch, declared)
    return torch.float32


def auto_class(spec: ArchSpec) -> type:
    return spec.auto_class()


def build_offloaded_model(model_dir: str | Path, spec: ArchSpec, dense: Mapping[str, torch.Tensor],
                          make_experts: Callable[[ExpertsSite, ExpertKernel], nn.Module], *,
                          dtype: str = "auto") -> tuple[nn.Module, list[ExpertsSite]]:
    """The HF model of `model_dir` (config + generation config) with offloaded experts and dense weights.

    `dense` maps runtime state-dict keys to tensors (the store's dense.safetensors). Returns the model in
    eval mode and the replaced experts sites in MoE-layer order.
    """
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(model_dir)
    torch_dtype = resolve_dtype(config, dtype)
    with torch.device("meta"):
        model = auto_class(spec).from_config(config, dtype=torch_dtype)
    sites = replace_experts(model, spec, make_experts)
    load_dense(model, dense, torch_dtype)
    recreate_meta_buffers(model)
    if (Path(model_dir) / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    model.eval()
    return model, sites


def load_dense(model: nn.Module, dense: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Assign every dense weight, tie what the config ties; refuse a store that does not fit the model."""
    expected = model.state_dict(keep_vars=True)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    converted = {}
    for key, tensor in dense.items():
        if key in expected and tensor.is_floating_point() and expected[key].is_floating_point():
            tensor = tensor.to(expected[key].dtype if expected[key].dtype != dtype else dtype)
        converted[key] = tensor
    result = model.load_state_dict(converted, strict=False, assign=True)
    missing = sorted(set(result.missing_keys) - tied)
    if missing or result.unexpected_keys:
        raise ValueError(
            f"the store's dense weights do not fit {type(model).__name__}: missing {missing[:5]}, "
            f"unexpected {sorted(result.unexpected_keys)[:5]}; re-pack the store (delete offload_dir)"
        )
    if tied & set(result.missing_keys):
        model.tie_weights()


def recreate_meta_buffers(model: nn.Module) -> None:
    """Fill the buffers left on the meta device by re-instantiating their owner from its config on CPU."""
    for owner_name, owner in list(model.named_modules()):
        meta = [name for name, buf in owner.named_buffers(recurse=False) if buf is not None and buf.is_meta]
        if not meta:
            continue
        config = getattr(owner, "config", None)
        if config is None:
            raise ValueError(
                f"module {owner_name!r} ({type(owner).__name__}) has buffers {meta} on the meta device and "
                "no "
                "config to rebuild them from; moeinf cannot load this model type yet"
            )
        fresh = type(owner)(config)
        for name in meta:
            value = getattr(fresh, name)
            owner.register_buffer(name, value, persistent=name not in owner._non_persistent_buffers_set)
    leftover = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise ValueError(f"weights {leftover[:5]} were not loaded (still on the meta device); "
                         "re-pack the store")
