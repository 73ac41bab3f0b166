"""moeinf's own matrix-vector products for the few rows of a decoded token on a quantised store's experts.

torch's weight-only CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) are built for
batches; at one row on an AVX2-only CPU they reach ~4 GB/s of weights, a third of what one core streams,
and fbgemm's faster int8 product needs a prepack per matrix (~8.5 ms) that a cache refilling its slots
cannot afford. No well-kept library that takes torch's layouts does better on AVX2 (llama.cpp's kernels
read its own formats and come only with the `llamacpp` extra), so csrc/gemv.cpp reads the store's own
layouts (moeinf/store/quant.py) once, in order, prefetching the next block (`moeinf bench quant` times
it against torch's kernels).

Sums are float32 in another order than torch's kernels, so results differ from theirs by rounding only;
quantised stores are not bit-exact to begin with. The int4 layout is torch's private packing, which depends
on the CPU capability torch runs at (rows in blocks of 32 on AVX2, of 64 on AVX-512): the kernel reads both,
and is used only where a probe shows the running torch packs in one of them (`int4_block_rows`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator

import torch

from .. import _kernels

DTYPES = {torch.float32: _kernels.DType.float32, torch.bfloat16: _kernels.DType.bfloat16,
          torch.float16: _kernels.DType.float16}
"""The dtypes of activations, outputs and scales the kernels read and write."""
INT4_BLOCK_ROWS = (32, 64)
"""Rows of one block of torch's int4 packing that the kernel reads: AVX2's, AVX-512's."""
Q8_BLOCK = 32
"""Activations per int8 block (and float32 scale) of the kernels' `int8_activations`."""


def available() -> bool:
    """Whether this CPU runs the kernels (x86-64 with AVX2, FMA and F16C)."""
    return _kernels.supported()


def expected_int4_packing(values: torch.Tensor, block_rows: int = 32) -> torch.Tensor:
    """The bytes csrc/gemv.hpp reads for the int4 `values` [N, K] (0..15, N a multiple of 16) packed in blocks
    of `block_rows` rows (32 or 64): byte (k, j) of a block holding row j in its low nibble and row
    block_rows / 2 + j in its high one; the last N % block_rows rows holding rows 2j and 2j + 1 of them in
    byte (k, j)."""
    rows, cols = values.shape
    v = values.to(torch.uint8)
    full = rows // block_rows * block_rows
    blocks = v[:full].reshape(-1, 2, block_rows // 2, cols)  # [B, half, j, K]
    packed = [(blocks[:, 0] | (blocks[:, 1] << 4)).transpose(1, 2).reshape(-1)]  # [B, K, block_rows / 2]
    if full != rows:
        tail = v[full:].reshape((rows - full) // 2, 2, cols)  # [j, lo/hi, K]
        packed.append((tail[:, 0] | (tail[:, 1] << 4)).t().reshape(-1))  # [K, (rows - full) / 2]
    return torch.cat(packed)


def quantise_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernels' `int8_activations` multiply by: `x` [n, K] (K a multiple of `Q8_BLOCK`) in float32,
    rounded to int8 in blocks of `Q8_BLOCK` values, each block with its scale d = amax / 127 (the values
    x * 127 / amax rounded to nearest even; llama.cpp's Q8_0): `q` int8 [n, K] and `d` float32 [n, K / 32],
    x ~ q * d."""
    blocks = x.float().reshape(x.shape[0], -1, Q8_BLOCK)  # [n, B, 32]
    amax = blocks.abs().amax(dim=-1, keepdim=True)  # [n, B, 1]
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse).clamp(-127, 127).to(torch.int8).reshape(x.shape)
    return q, (amax / 127.0).squeeze(-1)


@functools.cache
def int4_block_rows() -> int | None:
    """Rows per block of the running torch's int4 packing where the kernel reads it (`INT4_BLOCK_ROWS`), else
    None (a 176x64 probe: full blocks and a tail of 16 rows on AVX2's packing, of 48 on AVX-512's)."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (176, 64), dtype=torch.int32, generator=generator)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1).reshape(-1).view(torch.uint8)
    matching = (rows for rows in INT4_BLOCK_ROWS if torch.equal(packed, expected_int4_packing(values, rows)))
    return next(matching, None)


def int4_layout_matches() -> bool:
    """Whether the running torch packs int4 weights as the kernel reads them."""
    return int4_block_rows() is not None


@functools.cache
def workers(threads: int) -> _kernels.Workers:
    """The helper threads that split a product `threads` ways with the calling thread (kept for the
    process). Between products they spin for a moment, then sleep (csrc/workers.hpp): the products of a
    decoded layer follow each other faster than a sleeping thread wakes."""
    return _kernels.Workers(threads)


# A forked child inherits the cached pools but not their threads: it makes its own.
os.register_at_fork(after_in_child=workers.cache_clear)


_step = threading.local()


def compute_threads() -> int:
    """The threads a one-row product of the kernels splits across: torch's intra-op thread count (the
    compute's share of the CPU, e.g. `moeinf bench --threads`), or inside `kernel_step` the count torch had
    outside it."""
    return getattr(_step, "threads", 0) or torch.get_num_threads()


def in_kernel_step() -> bool:
    """Whether this thread is inside `kernel_step`."""
    return bool(getattr(_step, "threads", 0))


@contextlib.contextmanager
def kernel_step() -> Iterator[None]:
    """A decoded row's computation whose large products run in these kernels: torch's own ops inside run
    at one intra-op thread (`outer_threads` lends them the outer count back).

    Two thread pools that take turns on a small machine's cores wait for each other: a torch op that opens
    an OpenMP region (SDPA, a small product) between two of the kernels' products finds the kernels' helper
    spinning on the other core, and the helper then finds OpenMP's thread spinning there in turn, several
    times slower than the two alone. A decoded row's torch ops between the products (norms,
    elementwise ops, one query row's attention) are small enough for one thread. Only for computations
    whose every op gives the same bits at any thread count, or that `outer_threads` guards. torch's thread
    count is the process's: other threads' torch ops also run at one thread meanwhile (the planner's
    predictions; two models decoding at once in two threads would each see the other's count)."""
    threads = torch.get_num_threads()
    if threads == 1 or getattr(_step, "threads", 0):
        yield
        return
    _step.threads = threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _step.threads = 0


@contextlib.contextmanager
def outer_threads() -> Iterator[None]:
    """Inside `kernel_step`: torch at the outer intra-op thread count for what is inside (an op whose bits
    depend on it, as torch computes it there outside the step); elsewhere nothing changes."""
    threads = getattr(_step, "threads", 0)
    if not threads:
        yield
        return
    _step.threads = 0
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(1)
        _step.threads = threads


def _workers_for(x: torch.Tensor) -> _kernels.Workers | None:
    """One row splits across `compute_threads`; more rows, or one thread, run on the calling thread alone."""
    threads = compute_threads()
    return workers(threads) if threads > 1 and x.shape[0] == 1 else None


def _check(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> None:
    if x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError("gemv: x must be a contiguous CPU tensor")
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"gemv: x must be [rows, K] of float32/bfloat16/float16, got {x.dtype} "
                         f"{tuple(x.shape)}")
    _check_weight(weight, scales)


def _check_weight(weight: torch.Tensor, scales: torch.Tensor) -> None:
    for name, tensor in (("weight", weight), ("scales", scales)):
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"gemv: {name} must be a contiguous CPU tensor")
    if scales.dtype not in DTYPES:
        raise ValueError(f"gemv: scales must be float32/bfloat16/float16, got {scales.dtype}")


def int8_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, *,
              int8_activations: bool = False) -> torch.Tensor:
    """`x` [n, K] times the int8 weight `qweight` [N, K] with per-row `scales` [N], transposed: [n, N] in
    `x`'s dtype (what `_weight_int8pack_mm` computes; sums in float32, rounded once). With
    `int8_activations` (K a multiple of `Q8_BLOCK`), `x` is first rounded to int8 blocks
    (`quantise_activations`) and the products are integer."""
    x = x.contiguous()
    _check(x, qweight, scales)
    rows, cols = _int8_shape(qweight, scales)
    _check_x(x, cols, qweight, scales)
    out = torch.empty(x.shape[0], rows, dtype=x.dtype)
    _kernels.int8_rowwise_gemv(x.data_ptr(), DTYPES[x.dtype], x.shape[0], qweight.data_ptr(),
                               scales.data_ptr(), DTYPES[scales.dtype], out.data_ptr(), rows, cols,
                               _workers_for(x), int8_activations)
    return out


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int, *,
              int8_activations: bool = False, block_rows: int | None = None) -> torch.Tensor:
    """`x` [n, K] times the int4 weight [N, K] packed by `_convert_weight_to_int4pack_for_cpu` (`qweight`
    uint8 [N, K/2]) with group-wise (scale, zero) `scales` [K/G, N, 2], transposed: [n, N] in `x`'s dtype
    (what `_weight_int4pack_mm_for_cpu` computes; sums in float32, rounded once). Only where
    `int4_layout_matches`, or with `block_rows` the packing's rows per block. With `int8_activations` (the
    group size a multiple of `Q8_BLOCK`), as `int8_gemv`'s."""
    x = x.contiguous()
    _check(x, qweight, scales)
    rows, cols = _int4_shape(qweight, scales, group_size)
    _check_x(x, cols, qweight, scales)
    out = torch.empty(x.shape[0], rows, dtype=x.dtype)
    _kernels.int4_packed_gemv(x.data_ptr(), DTYPES[x.dtype], x.shape[0], qweight.data_ptr(),
                              scales.data_ptr(), DTYPES[scales.dtype], out.data_ptr(), rows, cols, group_size,
                              _workers_for(x), int8_activations, block_rows or _native_block_rows())
    return out


def _native_block_rows() -> int:
    rows = int4_block_rows()
    if rows is None:
        raise ValueError(f"int4 gemv: torch {torch.__version__} packs int4 weights in a layout the kernel "
                         f"does not read ({torch.backends.cpu.get_cpu_capability()})")
    return rows


def _int8_shape(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[int, int]:
    """[N, K] of an int8 weight and its per-row scales (ValueError where they do not fit)."""
    rows, cols = qweight.shape
    if qweight.dtype != torch.int8 or scales.shape != (rows,):
        raise ValueError(f"int8_gemv: qweight {qweight.dtype} {tuple(qweight.shape)} and scales "
                         f"{tuple(scales.shape)} do not fit")
    return rows, cols


def _int4_shape(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> tuple[int, int]:
    """[N, K] of a packed int4 weight and its group-wise scales (ValueError where they do not fit)."""
    rows, cols = qweight.shape[0], qweight.shape[1] * 2
    if (qweight.dtype != torch.uint8 or rows % 16 or group_size <= 0 or group_size % 2 or cols % group_size
            or scales.shape != (cols // group_size, rows, 2)):
        raise ValueError(f"int4_gemv: qweight {qweight.dtype} {tuple(qweight.shape)}, scales "
                         f"{tuple(scales.shape)} and group size {group_size} do not fit")
    return rows, cols


def _check_x(x: torch.Tensor, cols: int, qweight: torch.Tensor, scales: torch.Tensor) -> None:
    if x.shape[1] != cols:
        raise ValueError(f"gemv: x {tuple(x.shape)}, qweight {tuple(qweight.shape)} and scales "
                         f"{tuple(scales.shape)} do not fit")


class RowProduct:
    """One CPU row times a fixed quantised weight through the kernels, its checks done once. The runtime's
    quantised linears and expert slots make ~80 such products per decoded token; `int8_gemv`'s checks and
    argument handling per call cost as much as a small product (17 against 7 us for a 16x64 int8 weight).
    Holds `qweight` and `scales`, so the memory it reads lives as long as it does. `group_size` 0: int8
    (per-row scales); else int4 with that group size."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, group_size: int = 0, *,
                 int8_activations: bool = False) -> None:
        _check_weight(qweight, scales)
        shape = _int4_shape(qweight, scales, group_size) if group_size else _int8_shape(qweight, scales)
        self.rows, self.cols = shape
        self.qweight, self.scales = qweight, scales
        self.int8_activations = int8_activations
        self.weight = _kernels.RowWeight(qweight.data_ptr(), scales.data_ptr(), DTYPES[scales.dtype],
                                         self.rows, self.cols, group_size, int8_activations,
                                         _native_block_rows() if group_size else INT4_BLOCK_ROWS[0])
        """The weight as the kernels module reads it (`gated_rows` takes it too)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x` [1, K] (float32/bfloat16/float16, CPU) -> [1, N] in its dtype."""
        dtype = DTYPES.get(x.dtype)
        if x.shape != (1, self.cols) or dtype is None or x.device.type != "cpu":
            raise ValueError(f"RowProduct: x must be one CPU row of {self.cols} float32/bfloat16/float16 "
                             f"values, got {x.dtype} {tuple(x.shape)} on {x.device}")
        x = x.contiguous()
        out = torch.empty(1, self.rows, dtype=x.dtype)
        _kernels.row_weight_product(x.data_ptr(), dtype, 1, self.weight, out.data_ptr(), _pool())
        return out


def _pool() -> _kernels.Workers | None:
    """The helpers that split a one-row product (`compute_threads`), None at one thread."""
    threads = compute_threads()
    return workers(threads) if threads > 1 else None


def gated_rows(x: torch.Tensor, experts: list[tuple[RowProduct, RowProduct, int]],
               weights: torch.Tensor | None, out: torch.Tensor) -> None:
    """A decoded row's gated experts in one call of the kernels module: for each (gate_up, down, slot),
    out[slot] = down(silu(g) * u) * weights[slot] for (g | u) = gate_up(x), each step rounded as torch's
    ops round it (`_kernels.gated_rows`); without `weights`, out[slot] = down(...). `x` [1, K] and `out`
    [S, H] contiguous CPU tensors, `out` in the dtype torch's product of the two would have (x's without
    weights); `weights` [S] or [S, 1]."""
    dtype = DTYPES.get(x.dtype)
    if x.dim() != 2 or x.shape[0] != 1 or dtype is None or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(f"gated_rows: x must be one contiguous CPU row, got {x.dtype} {tuple(x.shape)}")
    if not experts:
        return
    cols, width = experts[0][0].cols, experts[0][1].rows
    slots = [slot for _, _, slot in experts]
    expected = x.dtype if weights is None else torch.promote_types(x.dtype, weights.dtype)
    if (out.dtype != expected or out.dim() != 2 or out.shape[1] != width or not out.is_contiguous()
            or out.device.type != "cpu" or min(slots) < 0 or max(slots) >= out.shape[0]):
        raise ValueError(f"gated_rows: out must be a contiguous CPU [{max(slots) + 1}+, {width}] {expected} "
                         f"tensor, got {out.dtype} {tuple(out.shape)}")
    if weights is not None and (weights.dtype not in DTYPES or weights.numel() != out.shape[0]
                                or not weights.is_contiguous() or weights.device.type != "cpu"):
        raise ValueError(f"gated_rows: weights must be {out.shape[0]} contiguous CPU float32/bfloat16/"
                         f"float16 values, got {weights.dtype} {tuple(weights.shape)}")
    for gate_up, down, _ in experts:
        if gate_up.cols != cols or gate_up.rows != 2 * down.cols or down.rows != width:
            raise ValueError(f"gated_rows: gate_up [{gate_up.rows}, {gate_up.cols}] and down [{down.rows}, "
                             f"{down.cols}] are not one gated expert of width {cols} -> {width}")
    if x.shape[1] != cols:
        raise ValueError(f"gated_rows: x has {x.shape[1]} values, the experts take {cols}")
    weight_type = DTYPES[weights.dtype] if weights is not None else dtype
    _kernels.gated_rows(x.data_ptr(), dtype, [(g.weight, d.weight, slot) for g, d, slot in experts],
                        0 if weights is None else weights.data_ptr(), weight_type, out.data_ptr(),
                        DTYPES[out.dtype], _pool())
