"""An exact store's one-row bf16 products with torch's bits, at the CPU's memory speed
(`OffloadConfig.bf16_row_kernel`).

On a CPU with AVX512_BF16 torch's bf16 `F.linear` runs oneDNN's matmul, which at one decoded row repacks the
weight on every call and streams well below what the memory delivers; moeinf's kernel streams each weight
once, in order. Those products are most of an exact store's decoded token. csrc/bf16_rows.hpp repeats
oneDNN's order of sums with its instructions, so the outputs are the same bits; what that order is was found
by crafted inputs, and so a shape takes the kernel only after `verified` finds torch's bits on such inputs
for that shape (oneDNN leaves small products to torch's own kernel, whose order differs; another oneDNN may
block otherwise). A CPU without AVX512_BF16 never takes it (torch runs its own bf16 GEMV there).

Where it applies: one row (`x.numel() == K`), bf16 input and weight on CPU, no bias, N a multiple of 16 and K
of 32. Everything else runs torch's `F.linear`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .. import _kernels
from .gemv import compute_threads, in_kernel_step, outer_threads, workers

K_BLOCK = 512
"""Values of K per block of oneDNN's sums (csrc/bf16_rows.hpp)."""
ROWS = 16
"""Outputs per group of the kernel: N must be a multiple."""
CHUNK = 32
"""K must be a multiple."""
_PROBE_ROWS = 512
"""Rows of crafted weights a probe builds; larger shapes repeat them."""
_MAX_PROBE_ROWS = 4096
"""Rows a probe multiplies at most: an LM head of 150k rows would otherwise copy gigabytes (oneDNN splits
large N between threads, not K, so their order of sums is that of the first 4096)."""
_LARGE_PAIRS = 6
"""Large values per crafted row, each with its negation elsewhere in the row."""


def available() -> bool:
    """Whether this CPU runs the kernel (AVX-512 F/BW/VL/DQ and BF16)."""
    return _kernels.bf16_rows_supported()


def crafted(rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 row x [cols] of +-1 and bf16 weights [rows, cols] whose products with it are N(0, 1) values
    and `_LARGE_PAIRS` pairs +-B (B ~ 2^12..2^20) per row at random places: each float32 sum cancels the
    large values and keeps the small ones rounded at the largest partial sum's scale, so its bf16 result
    depends on the order of the additions (~70% of rows differ between two orders)."""
    generator = torch.Generator().manual_seed(seed)
    made = min(rows, _PROBE_ROWS)
    w = torch.randn(made, cols, generator=generator)
    pairs = min(_LARGE_PAIRS, cols // 2)
    places = torch.argsort(torch.rand(made, cols, generator=generator), dim=1)[:, :2 * pairs]  # [made, 2p]
    large = torch.exp2(torch.randint(12, 20, (made, pairs), generator=generator).float())
    large = large * (1 + torch.rand(made, pairs, generator=generator))
    w.scatter_(1, places, torch.stack([large, -large], dim=2).reshape(made, 2 * pairs))
    signs = torch.randint(0, 2, (cols,), generator=generator).float() * 2 - 1
    w = (w * signs).bfloat16()
    if made < rows:
        w = w.repeat((rows + made - 1) // made, 1)[:rows]
    return signs.bfloat16(), w.contiguous()


@functools.lru_cache(maxsize=256)
def verified(rows: int, cols: int, threads: int) -> bool:
    """Whether the kernel gives torch's `F.linear` bits for one bf16 row and weights [rows, cols] at
    `threads` intra-op threads (torch's own bits change with them at some shapes: oneDNN splits K between
    threads where N is small): on the `crafted` inputs and on random ones, of up to `_MAX_PROBE_ROWS` rows.
    Only shapes it can run."""
    if not available() or rows % ROWS or cols % CHUNK or rows == 0:
        return False
    if threads != compute_threads():
        raise ValueError(f"verified: torch's bits at {threads} threads are checked only there")
    rows = min(rows, _MAX_PROBE_ROWS)
    with torch.no_grad(), outer_threads():
        for x, w in (crafted(rows, cols), (torch.randn(cols).bfloat16(), torch.randn(rows, cols).bfloat16())):
            out = torch.empty(rows, dtype=torch.bfloat16)
            _kernels.bf16_row_product(x.data_ptr(), w.data_ptr(), cols, rows, cols, out.data_ptr(),
                                      workers(threads) if threads > 1 else None, K_BLOCK)
            if not torch.equal(out.view(torch.int16), F.linear(x.unsqueeze(0), w)[0].view(torch.int16)):
                return False
    return True


@functools.lru_cache(maxsize=256)
def same_at_one_thread(rows: int, cols: int, dtype: torch.dtype, threads: int) -> bool:
    """Whether torch's `F.linear` of one row [cols] by weights [rows, cols] in `dtype` gives the same bits at
    one intra-op thread as at `threads`, on the `crafted` inputs and on random ones: where it does, such a
    product may run inside `gemv.kernel_step` (whose torch ops run at one thread)."""
    if threads == 1:
        return True
    rows = min(rows, _MAX_PROBE_ROWS)
    previous = torch.get_num_threads()
    try:
        with torch.no_grad():
            for x, w in (crafted(rows, cols), (torch.randn(cols), torch.randn(rows, cols))):
                x, w = x.unsqueeze(0).to(dtype), w.to(dtype)
                torch.set_num_threads(threads)
                outer = F.linear(x, w)
                torch.set_num_threads(1)
                if not torch.equal(F.linear(x, w), outer):
                    return False
    finally:
        torch.set_num_threads(previous)
    return True


def row_product(x: torch.Tensor, weight: torch.Tensor, *, split: bool = False) -> torch.Tensor | None:
    """`F.linear(x, weight)` for one row x [..., K] (`x.numel() == K`) by the kernel, with torch's bits;
    None where the kernel does not apply (module docstring) or the shape is not `verified`. On
    `compute_threads` inside `gemv.kernel_step`, or with `split` (where no torch op around opens an OpenMP
    region), else on the calling thread alone: beside torch ops that open OpenMP regions the kernel's
    helpers and OpenMP's threads wait for each other (`gemv.kernel_step`)."""
    if x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16 or weight.dim() != 2:
        return None
    rows, cols = weight.shape
    if (x.numel() != cols or x.device.type != "cpu" or weight.device.type != "cpu"
            or weight.stride(1) != 1 or weight.stride(0) < cols
            or not x.is_contiguous()
            or (x.requires_grad or weight.requires_grad) and torch.is_grad_enabled()):
        return None
    threads = compute_threads()
    if not verified(rows, cols, threads):
        return None
    out = x.new_empty((*x.shape[:-1], rows))
    _kernels.bf16_row_product(x.data_ptr(), weight.data_ptr(), weight.stride(0), rows, cols, out.data_ptr(),
                              workers(threads) if threads > 1 and (split or in_kernel_step()) else None,
                              K_BLOCK)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, *, split: bool = False) -> torch.Tensor:
    """`F.linear(x, weight)`, a row that `row_product` takes by the kernel (the same bits; `split` as
    there); torch's product inside `gemv.kernel_step` at the thread count outside it (whose bits HF's
    product has)."""
    out = row_product(x, weight, split=split)
    if out is None:
        with outer_threads():
            out = F.linear(x, weight)
    return out


class RowLinear(nn.Module):
    """An `nn.Linear` whose one-row bf16 calls without bias take `row_product`, and whose other calls run
    torch's `F.linear` as `linear` does (inside `gemv.kernel_step`, at the outer thread count); holds the
    linear's own parameters."""

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.weight = inner.weight
        self.bias = inner.bias
        self.in_features, self.out_features = inner.in_features, inner.out_features
        self.split_outside_step = False
        """A one-row call outside `gemv.kernel_step` on `compute_threads` too (`row_product`'s `split`): the
        LM head of a model whose layers decode in kernel steps."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return linear(x, self.weight, split=self.split_outside_step)
        with outer_threads():
            return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, bf16 rows")


def replace_linears(model: nn.Module) -> list[str]:
    """Replace every `nn.Linear` of `model` on CPU by a `RowLinear` where this CPU runs the kernel: those the
    kernel cannot take keep torch's product at the outer thread count inside `gemv.kernel_step`, so every
    product of a decoded row goes through here. The replaced modules' names; shapes are `verified` at their
    first one-row call."""
    if not available():
        return []
    targets = [name for name, module in model.named_modules()
               if type(module) is nn.Linear and module.weight.device.type == "cpu"]
    for name in targets:
        model.set_submodule(name, RowLinear(model.get_submodule(name)))
    return targets
