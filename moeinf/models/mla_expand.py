"""MLA's expanded keys and values kept between steps (`OffloadConfig.mla_expanded_max_bytes`).

transformers' MLA attentions (DeepSeek-V2/V3 and the families that copy them) cache the compressed
latents and, at every step, `expand_kv` runs the whole latent cache through `kv_b_proj` and copies the
result into per-head keys and values. At one decoded row that is a GEMM over all T cached rows, in
torch's CPU bf16 kernel ~6 us per cached row and layer on an AVX2 EPYC (T = 2000: ~9-16 ms per layer,
per token), for rows that are the same as at the last step.

`ExpandedKV` replaces `expand_kv` on one module instance and keeps what it returned: at the next call it
finds the first cached row that changed (bitwise, so a cache that was cropped, reordered or reset is
expanded again from there), runs `kv_b_proj` on the rows from there on only, and appends them to the kept
expansion. This is bit-equal to HF's call where `kv_b_proj`'s value for one row does not depend on the
other rows of the call: true of torch's CPU bf16/fp16 GEMM (each output one float32 dot product rounded
once; `compute.BATCHED_EXACT_DTYPES`), not of its float32 one (row-blocked), so other dtypes and devices,
and weights for which a check at the first call finds a row that depends on its neighbours, run HF's own
`expand_kv`. Where a row computed alone differs but a row's bits are the same in any call of two rows or
more (torch's CPU bf16 GEMM at one thread on a CPU without AVX512_BF16: its one-row calls take a GEMV
whose sums run in another order), a step's one new row is computed beside the row before it and the
second is kept (`rows_paired`, checked on the weight at the first call, at one intra-op thread only: at
two threads the GEMM splits a two-row call otherwise than a long one). The tensors returned have the
shapes, strides and values HF's have, so the attention that follows computes what it computes.

Memory: the expansion is (heads x (nope + v) + heads x (nope + rope)) values per cached token and layer,
~25x the latents (DeepSeek-V3: ~112 KB per token and layer in bf16). The modules of a model share
`max_bytes`; a layer whose expansion would pass its share drops it and runs HF's `expand_kv`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.bf16_rows import RowLinear
from ..kernels.gemv import outer_threads
from ..kernels.moe import BATCHED_EXACT_DTYPES, bits

LINEARS = (nn.Linear, RowLinear)
"""What `kv_b_proj` may be: HF's linear, or the same product by `bf16_rows` (`bf16_row_kernel`)."""
_CHECK_ROWS = 67
"""Rows of the first call's check that `kv_b_proj` computes each row alone (a prime, so no kernel block
size divides it)."""


@dataclass(frozen=True)
class Kept:
    """An expansion and the rows it was made from."""

    latents: torch.Tensor  # [B, 1, T, r] a copy of the latents expanded
    rot: torch.Tensor  # [B, 1, T, d_rot] a copy of the rotated keys used
    kv: torch.Tensor  # [B, 1, T, h * (nope + v)] kv_b_proj's output
    keys: torch.Tensor  # [B, h, T, nope + d_rot]

    def unchanged_rows(self, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> int:
        """How many leading rows of `kv_nope` and `k_rot` are bitwise those this was made from."""
        if self.latents.shape[0] != kv_nope.shape[0] or self.latents.shape[3] != kv_nope.shape[3] \
                or self.latents.dtype != kv_nope.dtype:
            return 0
        rows = min(self.latents.shape[2], kv_nope.shape[2])
        latents, rot = bits(kv_nope[:, :, :rows]), bits(k_rot[:, :, :rows])
        kept_latents, kept_rot = bits(self.latents[:, :, :rows]), bits(self.rot[:, :, :rows])
        if torch.equal(latents, kept_latents) and torch.equal(rot, kept_rot):
            return rows  # a decode step: one op per tensor
        same = (latents == kept_latents).all(-1) & (rot == kept_rot).all(-1)  # [B, 1, rows]
        return int(torch.argmin(same.all(0).view(-1).to(torch.uint8)))  # the first changed row


class ExpandedKV:
    """`expand_kv` of one MLA attention instance (`attention`), with the expansion of the rows it has seen
    kept; `max_bytes` the most its kept tensors may take."""

    def __init__(self, attention: nn.Module, max_bytes: int) -> None:
        self.attention = attention
        self.expand = attention.expand_kv  # the module's own, for what is not kept
        self.max_bytes = max_bytes
        self.nope = attention.qk_nope_head_dim
        self.value_dim = attention.v_head_dim
        self.rot_dim = attention.qk_rope_head_dim
        self.rows_alone: bool | None = None
        """Whether `kv_b_proj` gives a row the same bits in any call, checked at the first kept call."""
        self.rows_paired = False
        """Where not alone: whether it gives a row the same bits in any call of two rows or more (at one
        intra-op thread), checked at the first kept call."""
        self.kept: Kept | None = None
        """What the last call made, replaced whole (a call that runs beside another one on the module, on
        another thread, reads one consistent `Kept`; the two only keep each other from reusing rows)."""
        self.reused_rows = 0
        """Rows whose expansion a call took from the kept one (a count over calls, for tests and stats)."""

    def clear(self) -> None:
        self.kept = None

    def __call__(self, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = self.attention.kv_b_proj.weight
        if not self._keepable(kv_nope, k_rot, weight):
            self.clear()
            return self.expand(kv_nope, k_rot)
        batch, _, tokens, _ = kv_nope.shape
        kept = self.kept
        start = 0 if kept is None else kept.unchanged_rows(kv_nope, k_rot)
        heads = weight.shape[0] // (self.nope + self.value_dim)
        key_dim = self.nope + self.rot_dim
        per_token = batch * (weight.shape[0] + heads * key_dim) * kv_nope.element_size()
        if per_token * tokens > self.max_bytes:
            self.clear()
            return self.expand(kv_nope, k_rot)
        if self.rows_alone:
            new_kv = self.attention.kv_b_proj(kv_nope[:, :, start:])  # [B, 1, T - start, h * (nope + v)]
        else:  # rows_paired: never a one-row call where HF's call has more rows
            if batch * tokens < 2:
                self.clear()
                return self.expand(kv_nope, k_rot)
            lead = 1 if batch * (tokens - start) == 1 else 0  # a decode step: one row more, dropped after
            with outer_threads():
                single = torch.get_num_threads() == 1
                if single:
                    new_kv = self.attention.kv_b_proj(kv_nope[:, :, start - lead:])[:, :, lead:].contiguous()
            if not single:
                self.clear()
                return self.expand(kv_nope, k_rot)
        head_dim = self.nope + self.value_dim
        new_heads = new_kv.view(batch, tokens - start, heads, head_dim).transpose(1, 2)  # [B, h, new, .]
        new_keys = new_kv.new_empty(batch, heads, tokens - start, key_dim)
        new_keys[..., :self.nope].copy_(new_heads[..., :self.nope])
        new_keys[..., self.nope:].copy_(k_rot[:, :, start:].expand(-1, heads, -1, -1))
        if start:
            self.reused_rows += start
            kept = Kept(torch.cat((kept.latents[:, :, :start], kv_nope[:, :, start:]), dim=2),
                        torch.cat((kept.rot[:, :, :start], k_rot[:, :, start:]), dim=2),
                        torch.cat((kept.kv[:, :, :start], new_kv), dim=2),
                        torch.cat((kept.keys[:, :, :start], new_keys), dim=2))
        else:  # copies of the latents: a cache may write its tensors in place
            kept = Kept(kv_nope.clone(), k_rot.clone(), new_kv, new_keys)
        self.kept = kept
        values = kept.kv.view(batch, tokens, heads, head_dim).transpose(1, 2)[..., self.nope:]  # [B, h, T, v]
        return kept.keys, values

    def _keepable(self, kv_nope: torch.Tensor, k_rot: torch.Tensor, weight: torch.Tensor) -> bool:
        if kv_nope.device.type != "cpu" or kv_nope.dtype not in BATCHED_EXACT_DTYPES \
                or weight.dtype != kv_nope.dtype or self.attention.kv_b_proj.bias is not None \
                or type(self.attention.kv_b_proj) not in LINEARS or k_rot.dtype != kv_nope.dtype:
            return False
        if self.rows_alone is None:
            with outer_threads():  # as HF's expansion computes, inside a decoded row's `kernel_step` too
                self.rows_alone = _rows_alone(weight)
                single = torch.get_num_threads() == 1
                self.rows_paired = not self.rows_alone and single and _rows_paired(weight)
        return self.rows_alone or self.rows_paired


def _check_products(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_CHECK_ROWS` random rows in `weight`'s dtype and `F.linear` of them all in one call."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(_CHECK_ROWS, weight.shape[1], generator=generator).to(weight.dtype)
    return rows, nn.functional.linear(rows, weight)


def _rows_alone(weight: torch.Tensor) -> bool:
    """Whether `F.linear` with `weight` gives each of `_CHECK_ROWS` random rows the bits it gives it alone."""
    rows, together = _check_products(weight)
    alone = torch.cat([nn.functional.linear(rows[i:i + 1], weight) for i in range(_CHECK_ROWS)])
    return torch.equal(bits(together), bits(alone))


def _rows_paired(weight: torch.Tensor) -> bool:
    """Whether `F.linear` with `weight` gives each of `_CHECK_ROWS` random rows the bits it gives it in a call
    with the row before it, and in a call of the rows from the middle on."""
    rows, together = _check_products(weight)
    paired = torch.cat([nn.functional.linear(rows[i - 1:i + 1], weight)[1:] for i in range(1, _CHECK_ROWS)])
    middle = _CHECK_ROWS // 2
    tail = nn.functional.linear(rows[middle:], weight)
    return torch.equal(bits(together[1:]), bits(paired)) and torch.equal(bits(together[middle:]), bits(tail))


def has_expand_kv(module: nn.Module) -> bool:
    """An MLA attention of transformers' DeepSeek-V2 form: `expand_kv(kv_nope, k_rot)` through an
    `nn.Linear` `kv_b_proj` (or its `RowLinear`), with the head sizes it splits by."""
    sizes = ("qk_nope_head_dim", "v_head_dim", "qk_rope_head_dim")
    return callable(getattr(module, "expand_kv", None)) and not isinstance(module.expand_kv, ExpandedKV) \
        and type(getattr(module, "kv_b_proj", None)) in LINEARS and all(hasattr(module, a) for a in sizes)


def keep_expanded_kv(model: nn.Module, max_bytes: int) -> list[ExpandedKV]:
    """Give every MLA attention of `model` an `ExpandedKV` (its instance's `expand_kv`), the modules sharing
    `max_bytes` equally; the memos made (none when `max_bytes` is 0)."""
    targets = [module for module in model.modules() if has_expand_kv(module)]
    if not targets or max_bytes <= 0:
        return []
    memos = [ExpandedKV(module, max_bytes // len(targets)) for module in targets]
    for module, memo in zip(targets, memos, strict=True):
        module.expand_kv = memo
    return memos
