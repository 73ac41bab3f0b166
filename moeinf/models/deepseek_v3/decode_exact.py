"""An exact store's DeepSeek-V3 decoder layer, one decoded row, as one flat function of HF's own ops.

A decoded row's layer runs ~20 module calls and HF's attention around its products: `nn.Module.__call__`
with its hook checks for every part, transformers' argument-renaming decorators on the layer and the
attention, the attention interface's lookup and checks, and ~15 reads of config attributes through
transformers' `__getattribute__`. On the e2e model at two threads that Python is a few ms of a ~35 ms
token, where llama.cpp's whole token takes ~20.

`ExactRowDecode` is such a layer's forward on an exact store (CPU): a one-row decode step on a cache, with
no mask and SDPA attention, calls the same torch functions on the same tensors in the same order as HF's
forwards (`DeepseekV3DecoderLayer`, `DeepseekV3Attention`, `DeepseekV3MoE`, `sdpa_attention_forward`), and
each part's own `forward` (the norms, linears, router, experts, shared experts, `expand_kv`, the cache's
`update`), so the logits are HF's bit for bit (tests compare every step). Everything else takes the layer's
own forward: prefill, batches, masks, other attention implementations, training, extra keywords, a hook on
any part (which the flat function would not run), and a transformers whose forwards are not those the
flat function replays: it is used only where the sources of those four functions hash to one of
`REPLAYED_SOURCES` (a new transformers release then costs speed, never exactness).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.bf16_rows import same_at_one_thread
from ...kernels.gemv import compute_threads, kernel_step, outer_threads
from .decode_layer import FlatForward, PartsCheck

REPLAYED_SOURCES = {
    # transformers 5.24
    "f7e600b45cd621aa",
}
"""Digests (`source_digest`) of the transformers forwards that `ExactRowDecode.decode` replays."""

STEP_KEYWORDS = frozenset({"attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
                           "position_embeddings"})
"""The keywords of a decode step that the flat function passes on as the layer's forward does."""


def replayed_functions() -> list[Callable]:
    """transformers' functions whose computation `ExactRowDecode.decode` performs step for step."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    return [hf.DeepseekV3DecoderLayer.forward, hf.DeepseekV3Attention.forward, hf.DeepseekV3MoE.forward,
            sdpa_attention_forward]


def source_digest() -> str | None:
    """A digest of the sources of `replayed_functions` (None where a source cannot be read)."""
    digest = hashlib.sha256()
    try:
        for function in replayed_functions():
            digest.update(inspect.getsource(inspect.unwrap(function)).encode())
    except (OSError, TypeError):
        return None
    return digest.hexdigest()[:16]


class _Parts(PartsCheck):
    """One layer's parts as the flat function uses them, read once, and what `PartsCheck` checks."""

    def __init__(self, layer: nn.Module) -> None:
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

        attn, mlp = layer.self_attn, layer.mlp
        self.attn, self.mlp = attn, mlp
        self.input_norm = layer.input_layernorm.forward
        self.post_norm = layer.post_attention_layernorm.forward
        lora = attn.q_lora_rank is not None
        self.q_a = attn.q_a_proj.forward if lora else None
        self.q_a_norm = attn.q_a_layernorm.forward if lora else None
        self.q = attn.q_b_proj.forward if lora else attn.q_proj.forward
        self.kv_a, self.kv_a_norm, self.o = (attn.kv_a_proj_with_mqa.forward, attn.kv_a_layernorm.forward,
                                             attn.o_proj.forward)
        config = attn.config
        interleave = config.rope_interleave
        self.rotary = hf.apply_rotary_pos_emb_interleave if interleave else hf.apply_rotary_pos_emb
        self.config = config
        self.layer_idx = attn.layer_idx
        self.q_head = attn.qk_head_dim
        self.split_q = [attn.qk_nope_head_dim, attn.qk_rope_head_dim]
        self.split_kv = [attn.kv_lora_rank, attn.qk_rope_head_dim]
        self.latent, self.rope = self.split_kv
        self.scaling = attn.scaling
        self.moe = type(mlp) is hf.DeepseekV3MoE
        if self.moe:
            self.gate, self.experts = mlp.gate.forward, mlp.experts.forward
            self.shared = mlp.shared_experts.forward
            self.router_shape = tuple(mlp.gate.weight.shape)
        self.ok = type(attn) is hf.DeepseekV3Attention and attn.num_key_value_groups == 1
        """The attention is HF's own, without grouped heads (which `sdpa_attention_forward` handles in
        other ways)."""
        entries = [(parent._modules, name, child) for parent in layer.modules()
                   for name, child in parent._modules.items()]
        self.dicts, self.names, self.values = (list(column) for column in zip(*entries, strict=True))
        self.hooks = [hooks for part in self.values if part is not None
                      for hooks in (part._forward_hooks, part._forward_pre_hooks)]

    def router_at_one_thread(self) -> bool:
        """Whether torch's float32 product of the router (HF's: the row and weight widened) gives one row the
        same bits at one intra-op thread as at `compute_threads` (checked once per shape and count)."""
        return same_at_one_thread(*self.router_shape, torch.float32, compute_threads())


class ExactRowDecode(FlatForward):
    """The `forward` of one DeepSeek-V3 decoder layer of an exact store: a decoded row on a cache runs as
    one flat function of HF's ops (module docstring), everything else as the layer's own forward.

    With `kernel_step` (`OffloadConfig.bf16_row_kernel`, every linear a `bf16_rows.RowLinear`), the flat
    function runs in `gemv.kernel_step`: its products in moeinf's kernel, torch's own ops at one thread, the
    router's float32 product too where `bf16_rows.same_at_one_thread` finds its bits the same there, else at
    the outer thread count (as HF computes it)."""

    def __init__(self, layer: nn.Module, *, kernel_step: bool = False) -> None:
        super().__init__(layer)
        self.kernel_step = kernel_step

    def _bind(self, hidden_states: torch.Tensor, args: tuple, kwargs: dict[str, Any]) -> _Parts | None:
        """The layer's parts where this call is a one-row decode step the flat function replays, else None."""
        if args or hidden_states.dim() != 3 or hidden_states.shape[:2] != (1, 1) \
                or not STEP_KEYWORDS.issuperset(kwargs) or kwargs.get("attention_mask") is not None \
                or kwargs.get("position_embeddings") is None \
                or kwargs.get("cache", kwargs.get("past_key_values")) is None:
            return None
        parts = self._bound
        if parts is None or not parts.current():
            parts = self._bound = _Parts(self.layer)
        if not parts.ok or parts.hooked() or self.layer.training or torch.compiler.is_compiling() \
                or parts.config._attn_implementation != "sdpa":
            return None
        return parts

    def decode(self, parts: _Parts, hidden_states: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        """The layer's output [1, 1, H] (`flat`), in `gemv.kernel_step` where set."""
        if not self.kernel_step:
            return self.flat(parts, hidden_states, kwargs)
        with kernel_step():
            return self.flat(parts, hidden_states, kwargs)

    def flat(self, parts: _Parts, hidden_states: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        """The layer's output [1, 1, H]: the ops of HF's layer, attention (SDPA, no mask, one query row) and
        MoE forwards, in their order."""
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        # DeepseekV3DecoderLayer.forward
        residual = hidden_states
        hidden_states = parts.input_norm(hidden_states)
        # DeepseekV3Attention.forward (its keywords: the layer's, less those it names)
        attention_kwargs = {"position_ids": kwargs.get("position_ids"),
                            "use_cache": kwargs.get("use_cache", False)}
        if parts.q_a is None:
            q_states = parts.q(hidden_states)
        else:
            q_states = parts.q(parts.q_a_norm(parts.q_a(hidden_states)))
        q_states = q_states.view((1, 1, -1, parts.q_head)).transpose(1, 2)
        q_pass, q_rot = torch.split(q_states, parts.split_q, dim=-1)
        compressed_kv = parts.kv_a(hidden_states)
        kv_nope, k_rot = torch.split(compressed_kv, parts.split_kv, dim=-1)
        kv_nope = parts.kv_a_norm(kv_nope)
        kv_nope = kv_nope.view(1, 1, 1, parts.latent)
        k_rot = k_rot.view(1, 1, 1, parts.rope)
        cos, sin = kwargs["position_embeddings"]
        q_rot, k_rot = parts.rotary(q_rot, k_rot, cos, sin)
        kv_nope, k_rot = cache.update(kv_nope, k_rot, parts.layer_idx, kwargs=attention_kwargs)
        query_states = torch.cat((q_pass, q_rot), dim=-1)
        key_states, value_states = parts.attn.expand_kv(kv_nope, k_rot)
        # sdpa_attention_forward: one query row and no mask, so not causal
        attn_output = F.scaled_dot_product_attention(query_states, key_states, value_states, attn_mask=None,
                                                     dropout_p=0.0, scale=parts.scaling, is_causal=False)
        attn_output = attn_output.reshape(attn_output.shape[0], -1, 1, value_states.shape[-1])
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(1, 1, -1).contiguous()
        attn_output = parts.o(attn_output)
        hidden_states = residual + attn_output
        # the layer's MoE block (DeepseekV3MoE.forward) or dense MLP
        residual = hidden_states
        hidden_states = parts.post_norm(hidden_states)
        if parts.moe:
            shared_input = hidden_states
            # in a kernel step, the router's float32 product at one thread where that gives its bits at the
            # outer count (checked once: the check itself sets torch's thread count, so only in steps)
            with nullcontext() if not self.kernel_step or parts.router_at_one_thread() else outer_threads():
                _, topk_weights, topk_indices = parts.gate(hidden_states)
            hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
            hidden_states = parts.experts(hidden_states, topk_indices, topk_weights).view(1, 1, -1)
            hidden_states = hidden_states + parts.shared(shared_input)
        else:
            hidden_states = parts.mlp.forward(hidden_states)
        return residual + hidden_states


def fits(layer: nn.Module) -> bool:
    """transformers' own DeepSeek-V3 decoder layer, with HF's attention."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    return type(layer) is hf.DeepseekV3DecoderLayer and type(layer.self_attn) is hf.DeepseekV3Attention


def flatten_exact_layers(model: nn.Module, *, kernel_step: bool = False) -> list[str]:
    """Give each decoder layer of `model` that `fits` an `ExactRowDecode` (with `kernel_step`) as its
    forward, where the installed transformers' forwards are those it replays (`REPLAYED_SOURCES`); their
    names."""
    if source_digest() not in REPLAYED_SOURCES:
        return []
    targets = [name for name, module in model.named_modules() if fits(module)]
    for name in targets:
        layer = model.get_submodule(name)
        layer.forward = ExactRowDecode(layer, kernel_step=kernel_step)
    return targets
