"""DeepSeek-V3 attention's decode step on the latent cache (`OffloadConfig.mla_absorb`, quantised stores).

transformers' `DeepseekV3Attention` caches MLA's compressed latents (`kv_nope` [B, 1, T, r] after the
`kv_a_layernorm`, the rotated `k_rot` [B, 1, T, d_rot]) and, at every step, expands the whole latent cache
through `kv_b_proj` into per-head keys and values before SDPA: at one decoded row that is a GEMM over all T
cached rows plus ~30 small ops of splits, copies, expansions and transposes per layer, while the attention
itself is a few hundred multiply-adds. DeepSeek's own inference instead absorbs `kv_b_proj` into the query
and the output (the "weight absorption" of the DeepSeek-V2 paper): with `W_uk` [h, d_nope, r] and `W_uv`
[h, d_v, r] the key and value halves of `kv_b_proj`,

    score_t = (q_nope W_uk) . c_t + q_rot . k_rot_t         (per head, c_t the latent of token t)
    out     = W_uv^T (sum_t p_t c_t)

so a decoded row attends over the latent cache directly: per layer two small GEMVs and two batched
products over [T, r], no expansion. The sums run in another order (float32, over the latent), so this is
not bit-equal to HF's and applies to quantised stores only; calls that are not one-row decode steps on a
cache (prefill, no cache) run the module's own forward, as do exact stores.

A batch of one row (a chat, `generate` of one prompt) takes the same math in two calls of moeinf's kernels
module (csrc/mla.hpp) around the cache update, where the torch ops between the projections were ~40 per
layer, each costing more in dispatch than in arithmetic: the rotation and norm round to the model's dtype
after each op as HF's do, the attention sums in float32 and rounds once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ... import _kernels
from ...kernels.gemv import DTYPES
from ...kernels.norms import FusedRMSNorm


class AbsorbedMLADecode(nn.Module):
    """Wraps a `DeepseekV3Attention` (`inner`, whose own forward serves every other call): one-row decode
    steps on a cache attend over the latent cache with `kv_b_proj` absorbed (float32 copies of its key and
    value halves, taken when wrapped: the exact weights, whatever `inner.kv_b_proj` becomes later)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        heads, nope, rope = inner.num_heads, inner.qk_nope_head_dim, inner.qk_rope_head_dim
        self.heads, self.nope, self.rope, self.v_dim = heads, nope, rope, inner.v_head_dim
        weight = inner.kv_b_proj.weight.detach().float().view(heads, nope + self.v_dim, inner.kv_lora_rank)
        # laid out for per-head batched products (torch.bmm over the heads; einsum's planning cost more)
        self.register_buffer("w_uk", weight[:, :nope].contiguous(), persistent=False)  # [h, d_nope, r]
        w_uv_t = weight[:, nope:].transpose(1, 2).contiguous()  # [h, r, d_v]
        self.register_buffer("w_uv_t", w_uv_t, persistent=False)
        self.shape = _kernels.MlaShape(heads, nope, rope, inner.kv_lora_rank, self.v_dim)
        """The kernels' view of the heads, made once rather than at every decoded row."""
        self.interleave, self.scaling = bool(inner.config.rope_interleave), float(inner.scaling)
        """Read once: a config's attribute lookup costs ~10 us inside a decoded token."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, cache: Any = None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
        if cache is None or hidden_states.shape[1] != 1 or kwargs.get("output_attentions"):
            return self.inner(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        return self.decode(hidden_states, position_embeddings, attention_mask, cache, kwargs), None

    def decode(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
               attention_mask: torch.Tensor | None, cache: Any, kwargs: dict[str, Any]) -> torch.Tensor:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            apply_rotary_pos_emb,
            apply_rotary_pos_emb_interleave,
        )

        attn = self.inner
        batch = hidden_states.shape[0]
        if attn.q_lora_rank is None:
            q = attn.q_proj(hidden_states)
        else:
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden_states)))
        if self.one_call(hidden_states, position_embeddings, attention_mask):
            return self.decode_in_kernels(hidden_states, q, position_embeddings, attention_mask, cache,
                                          kwargs)
        q = q.view(batch, self.heads, 1, self.nope + self.rope)  # one row: [B, 1, h, d] is [B, h, 1, d]
        q_nope, q_rot = torch.split(q, [self.nope, self.rope], dim=-1)
        latent = attn.kv_a_proj_with_mqa(hidden_states)  # [B, 1, r + d_rot]
        kv_nope, k_rot = torch.split(latent, [attn.kv_lora_rank, self.rope], dim=-1)
        kv_nope = attn.kv_a_layernorm(kv_nope).view(batch, 1, 1, attn.kv_lora_rank)
        k_rot = k_rot.view(batch, 1, 1, self.rope)
        cos, sin = position_embeddings
        rotate = apply_rotary_pos_emb_interleave if attn.config.rope_interleave else apply_rotary_pos_emb
        q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)  # HF's rotation, bit for bit
        # the whole latent cache: [B, 1, T, r] and [B, 1, T, d_rot]
        kv_nope, k_rot = cache.update(kv_nope, k_rot, attn.layer_idx, kwargs=kwargs)
        latents = kv_nope[:, 0].float()  # [B, T, r]
        q_latent = torch.bmm(q_nope[:, :, 0].float().transpose(0, 1), self.w_uk).transpose(0, 1)  # [B, h, r]
        scores = torch.baddbmm(torch.bmm(q_rot[:, :, 0].float(), k_rot[:, 0].float().transpose(1, 2)),
                               q_latent, latents.transpose(1, 2))  # [B, h, T]
        scores *= attn.scaling
        if attention_mask is not None:  # SDPA's mask [B, 1, 1, T]: True (or 0) where a row may attend
            mask = attention_mask[:, 0, -1:, -scores.shape[-1]:]  # [B, 1, T]
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        out_latent = torch.bmm(scores.softmax(dim=-1), latents)  # [B, h, r]
        out = torch.bmm(out_latent.transpose(0, 1), self.w_uv_t).transpose(0, 1)  # [B, h, d_v]
        return attn.o_proj(out.to(hidden_states.dtype).reshape(batch, 1, self.heads * self.v_dim))


    def one_call(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                 attention_mask: torch.Tensor | None) -> bool:
        """Whether this step runs in the kernels module: one CPU row of a kernel dtype, a fused (Llama-form,
        `moeinf.kernels.norms`) latent norm, cos and sin of that dtype, no mask or a boolean one."""
        dtype = hidden_states.dtype
        norm = self.inner.kv_a_layernorm
        return (hidden_states.shape[0] == 1 and hidden_states.device.type == "cpu" and dtype in DTYPES
                and isinstance(norm, FusedRMSNorm) and norm.weight.dtype == dtype
                and all(t.dtype == dtype for t in position_embeddings)
                and (attention_mask is None or attention_mask.dtype == torch.bool))

    def decode_in_kernels(self, hidden_states: torch.Tensor, q: torch.Tensor,
                          position_embeddings: tuple[torch.Tensor, torch.Tensor],
                          attention_mask: torch.Tensor | None, cache: Any,
                          kwargs: dict[str, Any]) -> torch.Tensor:
        """`decode` of one row in two kernel calls around the cache update (csrc/mla.hpp)."""
        attn = self.inner
        latent = attn.kv_a_proj_with_mqa(hidden_states)  # [1, 1, r + d_rot]
        out = torch.empty(1, 1, self.heads * self.v_dim, dtype=hidden_states.dtype)
        norm = attn.kv_a_layernorm
        q_out = torch.empty(self.heads, self.nope + self.rope)  # float32
        self.attend_latent(q.contiguous(), latent.contiguous(), position_embeddings, attention_mask, cache,
                           kwargs, norm.weight.contiguous(), norm.eps, q_out, out)
        return attn.o_proj(out)

    def attend_latent(self, q: torch.Tensor, latent: torch.Tensor,
                      position_embeddings: tuple[torch.Tensor, torch.Tensor],
                      attention_mask: torch.Tensor | None, cache: Any, kwargs: dict[str, Any],
                      norm_weight: torch.Tensor, eps: float,
                      q_out: torch.Tensor, out: torch.Tensor) -> None:
        """One row's attention from its query `q` [h * (d_nope + d_rot)] and `latent` [r + d_rot] (contiguous,
        the model's dtype): rotation and the latent's norm (`norm_weight`, `eps`; the rotated query into the
        float32 `q_out` [h, d_nope + d_rot]), the cache update, then the attention over the latent cache into
        `out` [h * d_v] (the model's dtype); also the flat decode layers' (`decode_layer`)."""
        attn = self.inner
        dtype, rank, shape = latent.dtype, attn.kv_lora_rank, self.shape
        cos, sin = (t.contiguous() for t in position_embeddings)
        if q.numel() != self.heads * (self.nope + self.rope) or latent.numel() != rank + self.rope \
                or cos.numel() != self.rope or sin.numel() != self.rope:
            raise ValueError(f"MLA decode: q {tuple(q.shape)}, latent {tuple(latent.shape)} and cos "
                             f"{tuple(cos.shape)} do not fit {self.heads} heads of {self.nope} + {self.rope}")
        kv_nope = torch.empty(1, 1, 1, rank, dtype=dtype)
        k_rot = torch.empty(1, 1, 1, self.rope, dtype=dtype)
        _kernels.mla_prepare(q.data_ptr(), latent.data_ptr(), norm_weight.data_ptr(), eps,
                             cos.data_ptr(), sin.data_ptr(), self.interleave, DTYPES[dtype],
                             shape, q_out.data_ptr(), kv_nope.data_ptr(), k_rot.data_ptr())
        # the whole caches: [1, 1, T, r] and [1, 1, T, d_rot]
        latents, keys = cache.update(kv_nope, k_rot, attn.layer_idx, kwargs=kwargs)
        latents, keys = latents.contiguous(), keys.contiguous()
        tokens = latents.shape[2]
        if latents.dtype != dtype or keys.dtype != dtype or keys.shape[2] != tokens:
            raise ValueError(f"MLA decode: the cache holds {latents.dtype} {tuple(latents.shape)} and "
                             f"{keys.dtype} {tuple(keys.shape)}, not {dtype} rows of {rank} and {self.rope}")
        mask = 0
        if attention_mask is not None:  # SDPA's boolean mask [1, 1, 1, T]: True where the row may attend
            row = attention_mask[0, 0, -1, -tokens:]  # bool: one byte each, 0 or 1, as the kernel reads
            row = row if row.is_contiguous() else row.contiguous()
            mask = row.data_ptr()
        _kernels.mla_attend(q_out.data_ptr(), latents.data_ptr(), keys.data_ptr(), tokens,
                            self.w_uk.data_ptr(), self.w_uv_t.data_ptr(), self.scaling, mask,
                            DTYPES[dtype], shape, out.data_ptr())


def is_absorbable(module: nn.Module) -> bool:
    """transformers' DeepSeek-V3 attention (whose forward `AbsorbedMLADecode.decode` replays with `kv_b_proj`
    absorbed; other families' MLA copies may rotate or cache otherwise) with an `nn.Linear` `kv_b_proj`."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    return type(module) is DeepseekV3Attention and type(module.kv_b_proj) is nn.Linear


def absorb_mla(model: nn.Module) -> list[str]:
    """Wrap every absorbable attention of `model` in an `AbsorbedMLADecode`; the wrapped modules' names."""
    targets = [name for name, module in model.named_modules() if is_absorbable(module)]
    for name in targets:
        model.set_submodule(name, AbsorbedMLADecode(model.get_submodule(name)))
    return targets
