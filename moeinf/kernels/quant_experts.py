"""Expert compute on a quantised store's experts (formats in `moeinf/store/quant.py`).

The kernels are torch's own CPU weight-only ones, chosen by `moeinf bench quant` (one expert's forward
at Qwen3-30B-A3B geometry, against bf16 `F.linear` and against dequantising to bf16 first):
`_weight_int8pack_mm` (int8, one scale per row) and `_weight_int4pack_mm_for_cpu` (int4, group-wise
scale and zero). Activations stay in the model dtype; only the weights are quantised. The gate function,
activation and post-expert norm are the exact kernel's, so nothing about a family is repeated here.

`OffloadConfig.quant_expert_kernel` "dynamic-int8" computes an int8 store's one-row calls (a decoded
token's expert) as an integer GEMV instead: the row is rounded to int8 with its own scale and multiplied
by the stored int8 weight with `torch._int_mm` (exact int32 sums), then rescaled. At one row this is
faster than the weight-only kernel on the expert shapes; at 2-4 rows it is slower, so calls of more rows
stay weight-only.

"prepacked-int8" runs those one-row calls through fbgemm's `quantized::linear_dynamic` on the expert's
weights prepacked for it (the row rounded to 8 bits inside the op): about half the time of `_int_mm` at
one row, but a prepack costs ~8.5 ms per matrix and a second copy of its bytes, so it pays only for an
expert that stays where it is. The kernel keeps the packed weights keyed by the address of the slot's
`qweight`; that key names one expert only while no slot is refilled, which holds when the cache holds
every expert of the store (the builder allows this kernel only then, `OffloadConfig.quant_expert_kernel`).

"gemv" runs one-row calls through moeinf's own GEMV on the store's layouts (`moeinf.kernels.gemv`): on an
AVX2 CPU ~0.55x torch's int8 kernel's time and ~0.7x its int4 kernel's at one row, with no prepack, so it
serves a cache that refills its slots; calls of more rows stay weight-only.
"""

from __future__ import annotations

import functools
import platform
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .. import _kernels
from ..config import QUANT_ACTIVATIONS, QUANT_EXPERT_KERNELS
from ..store.quant import Quantization, padded_shape
from . import gemv
from .moe import ExpertKernel, GatedKernel

DEPRECATED_QTENSOR = r"torch\.quantize_per_tensor, torch\.quantize_per_channel"
"""torch 2.13 warns that its quantised tensor dtypes are deprecated; fbgemm's prepack still takes one."""


def quantised_linear(x: torch.Tensor, tensors: Mapping[str, torch.Tensor], name: str, quant: Quantization,
                     shape: tuple[int, int]) -> torch.Tensor:
    """`x` [n, K] times the quantised weight `name` ([N, K] logically) transposed: [n, N]."""
    return quantised_matmul(x, tensors[f"{name}.qweight"], tensors[f"{name}.scales"], quant, shape)


def dynamic_int8_row(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`x` [1, K] rounded to int8 (one symmetric scale) times the int8 weight `qweight` [N, K] with
    per-row `scales` [N], transposed: [1, N] in `x`'s dtype."""
    wide = x.float()
    largest = wide.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)  # [1, 1]
    row_scale = largest / 127
    q = torch.round(wide / row_scale).to(torch.int8)  # [1, K]
    return (torch._int_mm(q, qweight.t()) * row_scale * scales).to(x.dtype)  # [1, N]


def fbgemm_prepack(qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
    """The int8 weight `qweight` [N, K] with per-row `scales` [N] (and float32 `bias` [N]) prepacked for
    `quantized::linear_dynamic` (an fbgemm object holding its own copy of the weights)."""
    rows = int(qweight.shape[0])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=DEPRECATED_QTENSOR, category=UserWarning)
        tensor = torch._make_per_channel_quantized_tensor(qweight, scales.double(),
                                                          torch.zeros(rows, dtype=torch.long), 0)
    return torch.ops.quantized.linear_prepack(tensor, bias)


TORCH_INT8_INPUTS = 16
"""The inputs of `_weight_int8pack_mm` must be a multiple of this (torch 2.13: 8 on AVX2, 16 on AVX-512)."""


def on_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@functools.cache
def x86_vnni() -> bool | None:
    """Whether this x86 CPU has AVX512-VNNI (int8 products summed straight into int32); None off x86 or
    when /proc/cpuinfo cannot be read."""
    if not on_x86():
        return None
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        return None
    return "avx512_vnni" in flags


def fbgemm_reduce_range() -> bool:
    """Whether fbgemm's dynamic int8 product must round activations to 7 bits instead of 8.

    Without AVX512-VNNI, fbgemm multiplies unsigned 8-bit activations by signed 8-bit weights with
    `vpmaddubsw`, which adds each pair of products into a saturating int16: two 8-bit activations near
    255 times weights near 127 overflow it and the sums come out wrong (measured: errors of 0.5 where 0.03
    is the rounding's, on an AMD EPYC with AVX2 only). Seven-bit activations cannot overflow it (torch's
    `reduce_range`). With VNNI the products add into int32 and the 8th bit is kept. Off x86 (qnnpack)
    nothing saturates; on an x86 CPU whose flags cannot be read seven bits are always right."""
    return on_x86() and x86_vnni() is not True


def prepacked_int8(x: torch.Tensor, packed: Any) -> torch.Tensor:
    """`x` [n, K] (rounded to 8 bits with one scale inside the op, 7 where fbgemm's int16 sums could
    saturate: `fbgemm_reduce_range`) times the prepacked int8 weight [N, K], transposed: [n, N] in `x`'s
    dtype."""
    return torch.ops.quantized.linear_dynamic(x.float(), packed, fbgemm_reduce_range()).to(x.dtype)


def quantised_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, quant: Quantization,
                     shape: tuple[int, int], *, gemv_rows: bool = False,
                     int8_activations: bool = False) -> torch.Tensor:
    """`x` [n, K] times the weight [N, K] (`shape`) that `qweight` and `scales` quantise, transposed:
    [n, N]; with `gemv_rows`, through moeinf's own GEMV (`gemv_supported`; for a few CPU rows) instead of
    torch's kernels, and with `int8_activations` there on `x` rounded to int8 blocks where the shapes allow
    (`int8_activations_fit`)."""
    if quant.scheme == "int8":
        if gemv_rows:
            int8_rows = int8_activations and int8_activations_fit(quant, x.shape[-1])
            return gemv.int8_gemv(x, qweight, scales, int8_activations=int8_rows)
        if x.shape[-1] % TORCH_INT8_INPUTS:
            # torch 2.13's CPU kernel reads past inputs not a multiple of 8 on AVX2 and of 16 on AVX-512 (a
            # segfault or garbage in bf16/fp16): dequantise
            return F.linear(x, (qweight.to(scales.dtype) * scales[:, None]).to(x.dtype))
        return torch.ops.aten._weight_int8pack_mm(x, qweight, scales)
    rows, cols = shape
    padded_rows, padded_cols = padded_shape(quant, shape)
    if padded_cols != cols:
        x = F.pad(x, (0, padded_cols - cols))  # the padded inputs have zero weights
    if gemv_rows:
        out = gemv.int4_gemv(x, qweight, scales, quant.group_size,
                             int8_activations=int8_activations and int8_activations_fit(quant, padded_cols))
    else:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, qweight, quant.group_size, scales)
    return out[:, :rows] if padded_rows != rows else out


def int8_activations_fit(quant: Quantization, cols: int) -> bool:
    """Whether the GEMV can round a row of `cols` inputs to int8 blocks for a weight quantised with `quant`:
    the blocks of `gemv.Q8_BLOCK` inputs must tile the row (int8) or each int4 group (whose sizes, 32-256,
    always are multiples of it)."""
    if quant.scheme == "int8":
        return cols % gemv.Q8_BLOCK == 0
    return quant.group_size % gemv.Q8_BLOCK == 0


def is_silu(act: Any) -> bool:
    """Whether `act` is a plain SiLU module (torch's, or transformers' `SiLUActivation`, which calls it)."""
    from transformers import activations

    return type(act) is torch.nn.SiLU or type(act) is getattr(activations, "SiLUActivation", torch.nn.SiLU)


def is_default_silu_gate(apply_gate: Any) -> bool:
    """Whether `apply_gate` (an experts module's bound `_apply_gate`) is transformers' default gate with a
    SiLU: the output split into halves, silu(gate) * up."""
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # a transformers without the experts interface
        return False
    return (getattr(apply_gate, "__func__", None) is _default_apply_gate
            and is_silu(getattr(getattr(apply_gate, "__self__", None), "act_fn", None)))


def silu_mul_row(h: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of one CPU row `h` [1, 2I] ([gate | up]) in one call of the kernels module (three
    torch ops otherwise, ~30 us per expert inside a decoded token), or None where it does not apply. Each op
    rounds to the dtype as torch's do; the exponential is the C library's, so a value may differ from
    torch's by a rounding step: quantised stores only."""
    if (h.dim() != 2 or h.shape[0] != 1 or h.shape[1] % 2 or h.device.type != "cpu"
            or h.dtype not in gemv.DTYPES or not gemv.available()):
        return None
    h = h.contiguous()
    out = torch.empty(1, h.shape[1] // 2, dtype=h.dtype)
    _kernels.silu_mul(h.data_ptr(), gemv.DTYPES[h.dtype], 1, h.shape[1] // 2, out.data_ptr())
    return out


ROW_KERNELS = ("weight-only", "dynamic-int8", "prepacked-int8", "gemv")
"""How a quantised expert computes a one-row call (`OffloadConfig.quant_expert_kernel` once resolved)."""


def gemv_supported(quant: Quantization) -> bool:
    """Whether moeinf's own GEMV runs `quant`'s experts here: a CPU with AVX2, and for int4 a torch that packs
    as the kernel reads (`gemv.int4_layout_matches`)."""
    return gemv.available() and (quant.scheme == "int8" or gemv.int4_layout_matches())


@dataclass(frozen=True)
class QuantisedGatedKernel(ExpertKernel):
    """A gated expert (gate/up projection, the module's gate function, down projection) on quantised
    weights; `exact` supplies the module's gate function and post-expert norm."""

    exact: GatedKernel
    quant: Quantization
    shapes: Mapping[str, tuple[int, int]]
    """Logical [N, K] of `gate_up_proj` and `down_proj` (the index's quantisation record)."""
    row_kernel: str = "weight-only"
    """One of `ROW_KERNELS`, for one-row calls (more rows are always weight-only): "dynamic-int8" as an
    integer GEMV (`dynamic_int8_row`; int8 only), "prepacked-int8" through fbgemm on weights prepacked at the
    expert's first one-row call (int8 only; only while no slot is refilled: the cache holds every expert),
    "gemv" through moeinf's own GEMV (`gemv_supported`)."""
    int8_activations: bool = False
    """With `row_kernel` "gemv": the row rounded to int8 blocks first where the shapes allow
    (`OffloadConfig.quant_activations`)."""
    silu_gate: bool = field(init=False, compare=False, repr=False)
    """The module's gate is transformers' default with a SiLU (`is_default_silu_gate`): a decoded row's runs
    in one kernel call (`silu_mul_row`)."""
    packed: dict[int, Any] = field(default_factory=dict, compare=False, repr=False)
    """Address of a slot's `<name>.qweight` -> its prepacked weight."""
    rows: dict[tuple[str, int, int], gemv.RowProduct | None] = field(default_factory=dict, compare=False,
                                                                     repr=False)
    """With "gemv": (name, addresses of a slot's `<name>.qweight` and `.scales`) -> its bound one-row GEMV
    (None where the weight is padded). A slot keeps its addresses and shapes while experts come and go
    through it; the bound product holds the slot's tensors it was made from, so their memory outlives it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "silu_gate", is_default_silu_gate(self.exact.apply_gate))
        if not self.exact.has_gate or self.exact.has_bias or self.exact.is_transposed:
            raise ValueError("quantised experts must be gated, without biases, stored [out, in] "
                             "(what `moeinf pack --quant` accepts)")
        if self.row_kernel not in ROW_KERNELS:
            raise ValueError(f"row_kernel must be one of {ROW_KERNELS}, got {self.row_kernel!r}")
        if self.row_kernel in ("dynamic-int8", "prepacked-int8") and self.quant.scheme != "int8":
            raise ValueError(f"quant_expert_kernel {self.row_kernel!r} needs an int8 store, not "
                             f"{self.quant.describe()}")
        if self.row_kernel == "gemv" and not gemv_supported(self.quant):
            packing = " and a torch packing int4 as it reads" if self.quant.scheme == "int4" else ""
            raise ValueError(f"quant_expert_kernel 'gemv' needs an x86 CPU with AVX2, FMA and F16C{packing}; "
                             "use 'weight-only'")

    def __call__(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.linear(x, tensors, "gate_up_proj")  # [n, 2I]
        gated = silu_mul_row(h) if self.silu_gate else None
        h = self.exact.apply_gate(h) if gated is None else gated  # [n, I]
        out = self.linear(h, tensors, "down_proj")  # [n, H]
        return self.exact.post_norm(out) if self.exact.post_norm is not None else out

    def linear(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """`x` [n, K] times the expert's quantised weight `name`, transposed: [n, N]."""
        if x.shape[0] != 1 or self.row_kernel == "weight-only" or x.device.type != "cpu":
            return quantised_linear(x, tensors, name, self.quant, self.shapes[name])
        qweight, scales = tensors[f"{name}.qweight"], tensors[f"{name}.scales"]
        if self.row_kernel == "prepacked-int8":
            packed = self.packed.get(qweight.data_ptr())
            if packed is None:
                packed = self.packed[qweight.data_ptr()] = fbgemm_prepack(qweight, scales)
            return prepacked_int8(x, packed)
        if self.row_kernel == "dynamic-int8":
            return dynamic_int8_row(x, qweight, scales)
        row = self._bound(tensors, name)
        if row is not None:
            return row(x)
        return quantised_matmul(x, qweight, scales, self.quant, self.shapes[name], gemv_rows=True,
                                int8_activations=self.int8_activations)

    def rows_into(self, x: torch.Tensor, tensors: Sequence[dict[str, torch.Tensor]], slots: Sequence[int],
                  weights: torch.Tensor, buffer: Callable[[torch.dtype, int], torch.Tensor]) -> bool:
        """A decoded row's experts (their `tensors`, outputs for `slots`) in one kernel call
        (`gemv.gated_rows`): `buffer(dtype, width)[slot]` = the expert's output times `weights[slot]`, each
        value what `__call__` and torch's product with the weight give it. False (nothing done) where the
        call does not apply: more than one row, another kernel or gate, a post-expert norm, padded weights."""
        if (self.row_kernel != "gemv" or not self.silu_gate or self.exact.post_norm is not None
                or x.shape[0] != 1 or x.device.type != "cpu" or x.dtype not in gemv.DTYPES
                or weights.dtype not in gemv.DTYPES):
            return False
        experts = []
        for expert_tensors, slot in zip(tensors, slots, strict=True):
            gate_up, down = (self._bound(expert_tensors, name) for name in ("gate_up_proj", "down_proj"))
            if gate_up is None or down is None:
                return False
            experts.append((gate_up, down, slot))
        out = buffer(torch.promote_types(x.dtype, weights.dtype), self.shapes["down_proj"][0])
        gemv.gated_rows(x.contiguous(), experts, weights.reshape(-1), out)
        return True

    def _bound(self, tensors: dict[str, torch.Tensor], name: str) -> gemv.RowProduct | None:
        """The slot's bound one-row GEMV of `name` (None where the weight is padded)."""
        qweight, scales = tensors[f"{name}.qweight"], tensors[f"{name}.scales"]
        key = (name, qweight.data_ptr(), scales.data_ptr())
        row = self.rows.get(key, False)
        if row is False:
            row = self.rows[key] = self.row_product(qweight, scales, name)
        return row

    def row_product(self, qweight: torch.Tensor, scales: torch.Tensor, name: str) -> gemv.RowProduct | None:
        """`name`'s one-row GEMV bound to a slot's tensors (None where the weight is padded)."""
        return bound_row_product(qweight, scales, self.quant, self.shapes[name],
                                 int8_activations=self.int8_activations)


def bound_row_product(qweight: torch.Tensor, scales: torch.Tensor, quant: Quantization,
                      shape: tuple[int, int], *, int8_activations: bool = False) -> gemv.RowProduct | None:
    """The one-row GEMV bound to a weight quantised with `quant` (logically `shape` [N, K]), rounding the
    row to int8 blocks with `int8_activations` where the shapes allow; None where the store padded the
    weight (`quantised_matmul` pads the row and trims the output then)."""
    if padded_shape(quant, shape) != shape:
        return None
    group = quant.group_size if quant.scheme == "int4" else 0
    rounded = int8_activations and int8_activations_fit(quant, shape[1])
    return gemv.RowProduct(qweight, scales, group, int8_activations=rounded)


def resolve_expert_kernel(expert_kernel: str, quant: Quantization, *, all_resident: bool) -> str:
    """`OffloadConfig.quant_expert_kernel` for a store quantised with `quant` whose every expert the cache
    holds (`all_resident`, on CPU) or not. "auto": "gemv" where it runs (`gemv_supported`: faster at one
    row than torch's int8 kernel and fbgemm's prepacked one); else "prepacked-int8" for an int8 store held
    whole where torch has fbgemm; "dynamic-int8" for another int8 store where the CPU has AVX512-VNNI
    (without it `torch._int_mm` at one row is several times slower than the weight-only kernel); else
    "weight-only"."""
    if expert_kernel not in QUANT_EXPERT_KERNELS:
        raise ValueError(f"quant_expert_kernel must be one of {QUANT_EXPERT_KERNELS}, got {expert_kernel!r}")
    fbgemm = "fbgemm" in torch.backends.quantized.supported_engines
    if expert_kernel == "prepacked-int8" and not (all_resident and fbgemm):
        raise ValueError("quant_expert_kernel 'prepacked-int8' needs torch's fbgemm and a CPU cache holding "
                         "every expert of the store (device_cache >= 100%): an expert's packed weights are "
                         "kept for its slot, which must never be refilled; use 'gemv' or 'dynamic-int8'")
    if expert_kernel != "auto":
        return expert_kernel
    if gemv_supported(quant):
        return "gemv"
    if quant.scheme != "int8":
        return "weight-only"
    if all_resident and fbgemm:
        return "prepacked-int8"
    return "dynamic-int8" if x86_vnni() else "weight-only"


def quantised_kernel(kernel: ExpertKernel, quant: Quantization, shapes: Mapping[str, tuple[int, int]],
                     expert_kernel: str = "weight-only", *, all_resident: bool = False,
                     activations: str = "auto") -> ExpertKernel:
    """The kernel computing `kernel`'s experts from a store quantised with `quant`; `expert_kernel` one of
    `QUANT_EXPERT_KERNELS` (`resolve_expert_kernel`); `all_resident`: the CPU cache holds every expert;
    `activations` one of `QUANT_ACTIVATIONS` (`resolve_activations`)."""
    if not isinstance(kernel, GatedKernel):
        raise ValueError(f"{type(kernel).__name__} experts cannot run from a quantised store; re-pack "
                         "without --quant")
    row_kernel = resolve_expert_kernel(expert_kernel, quant, all_resident=all_resident)
    int8_rows = row_kernel == "gemv" and resolve_activations(activations, quant)
    return QuantisedGatedKernel(kernel, quant, {name: tuple(shape) for name, shape in shapes.items()},
                                row_kernel=row_kernel, int8_activations=int8_rows)


def resolve_activations(setting: str, quant: Quantization) -> bool:
    """`OffloadConfig.quant_activations` for experts quantised with `quant`, as "the GEMV rounds a decoded
    row to int8 blocks". "auto": for int4 experts, whose float GEMV is bound by turning nibbles into floats
    (int8 rows take less time per expert from DRAM); not for int8 experts, whose float GEMV already streams
    what one core reads from DRAM (int8 rows are no faster there)."""
    if setting not in QUANT_ACTIVATIONS:
        raise ValueError(f"quant_activations must be one of {QUANT_ACTIVATIONS}, got {setting!r}")
    if setting == "auto":
        return quant.scheme == "int4"
    return setting == "int8"
