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
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


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
