"""Dense linears on quantised weights beside a quantised store's experts (`OffloadConfig.quant_dense`).

A quantised store quantises the routed experts on disk; every other weight is stored exact. Some dense
weights cost as much per token as the routed experts: the shared experts (DeepSeek's `shared_experts`,
Qwen2-MoE's `shared_expert`) run for every token and, at DeepSeek/Qwen geometry, are as large as a routed
expert each; the LM head is the largest single matrix. Once quantisation has made the routed experts cheap,
these bf16 GEMVs are much of a decoded token's time. `quant_dense` quantises them at load time (the dense
file on disk stays exact, routers stay exact: they decide the routing, and an exact store never does this)
with one of two kernels (`OffloadConfig.quant_dense_kernel`):

- "weight-only": the store's scheme and group size, torch's weight-only kernels (`quantised_matmul`), a
  one-row call through moeinf's own GEMV where it runs (`moeinf.kernels.gemv`);
- "int8": the same with per-row int8 weights whatever the store's scheme (an int4 store's LM head and
  shared experts in int4 cost more greedy tokens than its experts do);
- "dynamic-int8": per-row int8 weights and activations quantised to 8 bits per call, fbgemm's
  `quantized::linear_dynamic`. At one decoded row this streams about twice the bytes per second of torch's
  weight-only int8 kernel, and more than its int4 kernel computes: an int8 store's shared experts and LM
  head take about half the time, an int4 store's LM head less. The
  activations' 8-bit rounding (one scale per call) is a further approximation, measured by
  `moeinf bench quant`.

A gated MLP (the shared experts: `gate_proj`, `up_proj`, `down_proj`, `act_fn`) becomes one module whose
gate and up projections are one quantised matrix: one kernel call instead of two.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from ..config import QUANT_DENSE, QUANT_DENSE_KERNELS
from ..store.quant import Quantization, quantise
from . import gemv
from .gemv import RowProduct
from .quant_experts import (
    bound_row_product,
    fbgemm_prepack,
    gemv_supported,
    is_silu,
    prepacked_int8,
    quantised_matmul,
    resolve_activations,
    silu_mul_row,
)

LinearFactory = Callable[[nn.Linear], nn.Module]
"""Builds the quantised replacement of one linear."""


class QuantisedLinear(nn.Module):
    """`nn.Linear` on a weight quantised with `quant` (the exact weight is dropped); a one-row call (a decoded
    token) through moeinf's own GEMV where it runs (`gemv_supported`), more rows through torch's kernels."""

    def __init__(self, linear: nn.Linear, quant: Quantization, *, int8_activations: bool = False) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.quant = quant
        self.int8_activations = int8_activations
        """A one-row call through moeinf's GEMV rounds the row to int8 blocks first, where the shapes allow
        (as a quantised store's experts do with `OffloadConfig.quant_activations`)."""
        self.gemv_rows = gemv_supported(quant)
        self.shape = (int(weight.shape[0]), int(weight.shape[1]))
        parts = quantise(weight, quant)
        self.register_buffer("qweight", parts["qweight"])
        self.register_buffer("scales", parts["scales"])
        self.bias = linear.bias
        self._row: RowProduct | None = None

    def row_product(self) -> RowProduct | None:
        """The bound one-row GEMV of the current buffers (None where the GEMV does not run or the weight
        is padded), made again if the buffers were replaced (e.g. by `.to`)."""
        row = self._row
        if row is not None and row.qweight is self.qweight and row.scales is self.scales:
            return row
        if not self.gemv_rows or self.qweight.device.type != "cpu":
            return None
        self._row = bound_row_product(self.qweight, self.scales, self.quant, self.shape,
                                      int8_activations=self.int8_activations)
        return self._row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        row, buffers = self._row, self._buffers
        if (row is not None and x.shape[-1] == x.numel() == row.cols and x.device.type == "cpu"
                and row.qweight is buffers["qweight"] and row.scales is buffers["scales"]):
            # a decoded row on the bound product of the current buffers: the few checks it needs, read
            # straight from the module's dicts (each `nn.Module` attribute lookup costs ~1-3 us in a token,
            # and an attention makes three such calls per layer)
            out = row(x.reshape(1, row.cols)).view(*x.shape[:-1], row.rows)
            bias = self._parameters.get("bias", self.__dict__.get("bias"))
            return out + bias if bias is not None else out
        flat = x.reshape(-1, x.shape[-1])  # [n, K]
        if not flat.is_contiguous():
            flat = flat.contiguous()
        one_cpu_row = flat.shape[0] == 1 and flat.device.type == "cpu"
        row = self.row_product() if one_cpu_row else None
        if row is not None:
            out = row(flat).reshape(*x.shape[:-1], self.shape[0])
            return out + self.bias if self.bias is not None else out
        out = quantised_matmul(flat, self.qweight, self.scales, self.quant, self.shape,
                               gemv_rows=self.gemv_rows and one_cpu_row)  # [n, N]
        out = out.reshape(*x.shape[:-1], self.shape[0])
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return f"in_features={self.shape[1]}, out_features={self.shape[0]}, {self.quant.describe()}"


class DynamicInt8Linear(nn.Module):
    """`nn.Linear` on per-row int8 weights with the input quantised to 8 bits at each call (fbgemm's
    `quantized::linear_dynamic`, one activation scale per call); computes in float32, returns the input's
    dtype. The exact weight is dropped; the prepacked weight is an fbgemm object, not a buffer."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.shape = (int(weight.shape[0]), int(weight.shape[1]))
        parts = quantise(weight, Quantization.of("int8"))
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.packed = fbgemm_prepack(parts["qweight"], parts["scales"], bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = prepacked_int8(x.reshape(-1, x.shape[-1]), self.packed)  # [n, N]
        return out.reshape(*x.shape[:-1], self.shape[0])

    def extra_repr(self) -> str:
        return f"in_features={self.shape[1]}, out_features={self.shape[0]}, dynamic int8"


class FusedGatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))` with `gate` and `up` as one [2I, H] linear: one kernel call."""

    def __init__(self, mlp: nn.Module, make: LinearFactory) -> None:
        super().__init__()
        gate, up = mlp.gate_proj, mlp.up_proj
        self.intermediate = int(gate.weight.shape[0])
        fused = nn.Linear(gate.in_features, 2 * self.intermediate, bias=False, device="meta")
        weight = torch.cat([gate.weight.detach(), up.weight.detach()])  # [2I, H]
        fused.weight = nn.Parameter(weight, requires_grad=False)
        self.gate_up_proj = make(fused)
        self.down_proj = make(mlp.down_proj)
        self.act_fn = mlp.act_fn
        self.silu = is_silu(mlp.act_fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.silu and x.numel() == x.shape[-1] and x.device.type == "cpu" and x.dtype in gemv.DTYPES:
            rows = [m.row_product() if isinstance(m, QuantisedLinear) else None
                    for m in (self.gate_up_proj, self.down_proj)]
            if None not in rows:  # a decoded row: the whole MLP in one kernel call, as the steps below round
                out = torch.empty(1, rows[1].rows, dtype=x.dtype)
                gemv.gated_rows(x.reshape(1, -1).contiguous(), [(rows[0], rows[1], 0)], None, out)
                return out.view(*x.shape[:-1], rows[1].rows)
        h = self.gate_up_proj(x)  # [..., 2I]
        gated = silu_mul_row(h.reshape(1, -1)) if self.silu and h.numel() == 2 * self.intermediate else None
        if gated is not None:  # a decoded row: silu(gate) * up in one kernel call
            return self.down_proj(gated.view(*h.shape[:-1], self.intermediate))
        gate, up = h.split(self.intermediate, dim=-1)  # [..., I] each
        return self.down_proj(self.act_fn(gate) * up)


def is_fusable_mlp(module: nn.Module) -> bool:
    """A gated MLP without biases computing `down(act(gate(x)) * up(x))` (transformers' `...MLP`)."""
    parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return (type(module).__name__.endswith("MLP") and hasattr(module, "act_fn")
            and all(type(p) is nn.Linear and p.bias is None for p in parts)
            and set(dict(module.named_children())) == {"gate_proj", "up_proj", "down_proj", "act_fn"})


def resolve_kernel(kernel: str) -> str:
    """`auto`: "int8" where moeinf's GEMV runs (`gemv_supported`; faster than fbgemm at one row; int8
    rather than an int4 store's own scheme, whose LM head and shared experts in int4 cut its greedy
    agreement with bf16 markedly), else "dynamic-int8" where torch has fbgemm (x86), else
    "weight-only"."""
    if kernel not in QUANT_DENSE_KERNELS:
        raise ValueError(f"quant_dense_kernel must be one of {QUANT_DENSE_KERNELS}, got {kernel!r}")
    if kernel != "auto":
        return kernel
    if gemv_supported(Quantization.of("int8")):
        return "int8"
    return "dynamic-int8" if "fbgemm" in torch.backends.quantized.supported_engines else "weight-only"


def quantise_dense(model: nn.Module, shared_experts: str | None, quant: Quantization, which: str,
                   kernel: str = "weight-only", fuse: bool = False, activations: str = "auto") -> list[str]:
    """Replace the linears `which` names (one of `QUANT_DENSE`) in `model` by quantised ones computed with
    `kernel` ("weight-only", "int8" or "dynamic-int8", resolved); the replaced modules' names. Shared
    experts are the modules whose names the pattern `shared_experts` matches
    (`ArchSpec.shared_experts_module`); with `fuse`, a fusable gated one is replaced whole. `activations`
    (`OffloadConfig.quant_activations`) decides, per scheme as for the experts, whether a decoded row
    is rounded to int8 blocks before the GEMV of a "weight-only" or "int8" linear."""
    if which not in QUANT_DENSE:
        raise ValueError(f"quant_dense must be one of {QUANT_DENSE}, got {which!r}")
    if kernel not in QUANT_DENSE_KERNELS[1:]:
        raise ValueError(f"quant_dense_kernel must be resolved to one of {QUANT_DENSE_KERNELS[1:]}, "
                         f"got {kernel!r}")

    def make(linear: nn.Linear) -> nn.Module:
        if kernel == "dynamic-int8":
            return DynamicInt8Linear(linear)
        scheme = Quantization.of("int8") if kernel == "int8" else quant
        return QuantisedLinear(linear, scheme, int8_activations=resolve_activations(activations, scheme))

    targets: list[tuple[str, nn.Module]] = []
    if which != "none" and shared_experts is not None:
        for name, module in model.named_modules():
            if re.search(shared_experts, name):
                if fuse and is_fusable_mlp(module):
                    targets.append((name, FusedGatedMLP(module, make)))
                else:
                    targets += [(f"{name}.{child}", make(sub)) for child, sub in module.named_children()
                                if type(sub) is nn.Linear]
    if which == "shared-experts+lm-head":
        head = model.get_output_embeddings()
        names = [name for name, module in model.named_modules() if module is head]
        if type(head) is nn.Linear and names:
            targets.append((names[0], make(head)))
    for name, replacement in targets:
        model.set_submodule(name, replacement)
    return [name for name, _ in targets]
