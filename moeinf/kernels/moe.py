"""Exact expert compute: one expert's math, the grouping of a layer's tokens, and HF's combine.

    route (top_k_index [T, k]) -> Dispatch (rows grouped by expert, in HF's row order)
      -> ExpertOutputs.compute per expert, in any order (kernel, then the router weight)
      -> ExpertOutputs.result: HF's reduction over the k slots of each token

An `ExpertKernel` turns the routed hidden states of one expert into its output, given that expert's
tensors in the store's runtime layout (`moeinf/spec.py`). The reference is what transformers runs by
default, `grouped_mm_experts_forward` of `transformers/integrations/moe.py` (Switch: its eager
per-expert loop); why this reproduces it bit for bit is in docs/internals.md ("Exactness").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import bf16_rows

BATCHED_EXACT_DTYPES = (torch.bfloat16, torch.float16)
"""Dtypes in which a CPU `bmm` over experts stacked (rows padded) gives each row the bits `F.linear` gives it
on that expert's rows alone (checked by tests/test_runtime_exact.py). Not float32: there the value of a row
depends on the row count (the kernel's row blocking), so float32 experts are computed one by one."""


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as integers of the same width, to compare bitwise (-0.0 is not 0.0, NaN is itself): what
    "bit-equal" means in the checks of the runtime's exact paths."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def weigh_into(y: torch.Tensor, weights: torch.Tensor, start: int,
               buffer: Callable[[torch.dtype, int], torch.Tensor]) -> None:
    """torch's product of expert outputs `y` [n, H] with their router weights `weights[start:start + n]`, into
    rows start.. of `buffer(dtype, H)` (dtype that of the product): the values HF weighs each slot with."""
    end = start + y.shape[0]
    out = buffer(torch.promote_types(y.dtype, weights.dtype), y.shape[-1])
    torch.mul(y, weights[start:end], out=out[start:end])


class ExpertKernel(ABC):
    """Computes one expert: `[n, H]` routed states + that expert's tensors -> `[n, H]` outputs."""

    stable: bool = False
    """True when the reference takes each expert's tokens in increasing order (a stable sort), False
    when it groups them with `torch.sort`'s default as HF's grouped_mm path does (see `Dispatch`)."""

    @abstractmethod
    def __call__(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def outputs(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                dispatch: Dispatch) -> ExpertOutputs:
        """Where a layer's expert outputs are kept and how they are combined: HF's grouped_mm reduction
        (`ExpertOutputs`), unless a family's reference combines them otherwise (`moeinf.hf.adapters`)."""
        return ExpertOutputs(hidden_states, top_k_weights, dispatch)

    def many(self, x: torch.Tensor, tensors: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor | None:
        """Several experts at once: `x` [G, n, H] (expert g's rows, padded to n) -> [G, n, H], each row
        bit-equal to what `__call__` gives it; None when this kernel cannot (the caller loops)."""
        return None

    def rows_into(self, x: torch.Tensor, tensors: Sequence[dict[str, torch.Tensor]], slots: Sequence[int],
                  weights: torch.Tensor, buffer: Callable[[torch.dtype, int], torch.Tensor]) -> bool:
        """A decoded row `x` [1, H] through several experts at once, each output times its router weight
        `weights[slot]` stored in `buffer(dtype, width)[slot]` (dtype that of torch's product), each value
        what `__call__` and that product give it; False (nothing done) when this kernel cannot."""
        return False


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool,
            row_kernel: bool = False) -> torch.Tensor:
    # Transposed experts (GPT-OSS) store [in, out]; the others [out, in] as nn.Linear does.
    if transposed:
        out = x @ weight
    else:
        out = bf16_rows.linear(x, weight) if row_kernel else F.linear(x, weight)
    return out + bias if bias is not None else out


@dataclass(frozen=True)
class GatedKernel(ExpertKernel):
    """Experts of the transformers experts interface (Mixtral, Qwen-MoE, DeepSeek, OLMoE, GPT-OSS...).

    The flags and the gate function are read from the original experts module so that nothing about a
    family is repeated here: `apply_gate` is the module's `_apply_gate` (concatenated or interleaved
    gate/up, clamps, alpha), `act` its `act_fn` for ungated experts, `post_norm` its optional post-expert
    norm.
    """

    has_gate: bool
    has_bias: bool
    is_transposed: bool
    apply_gate: Callable[[torch.Tensor], torch.Tensor] | None
    act: Callable[[torch.Tensor], torch.Tensor] | None
    post_norm: Callable[[torch.Tensor], torch.Tensor] | None = None
    row_kernel: bool = False
    """One-row bf16 products by `bf16_rows` (the same bits as `F.linear`): `OffloadConfig.bf16_row_kernel`."""

    def __call__(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        up_name = "gate_up_proj" if self.has_gate else "up_proj"
        up_bias = tensors[f"{up_name}_bias"] if self.has_bias else None
        h = _linear(x, tensors[up_name], up_bias, self.is_transposed, self.row_kernel)  # [n, 2I] or [n, I]
        h = self.apply_gate(h) if self.has_gate else self.act(h)  # [n, I]
        down_bias = tensors["down_proj_bias"] if self.has_bias else None
        out = _linear(h, tensors["down_proj"], down_bias, self.is_transposed, self.row_kernel)  # [n, H]
        return self.post_norm(out) if self.post_norm is not None else out

    def rows_into(self, x: torch.Tensor, tensors: Sequence[dict[str, torch.Tensor]], slots: Sequence[int],
                  weights: torch.Tensor, buffer: Callable[[torch.dtype, int], torch.Tensor]) -> bool:
        """A decoded row through each expert, then torch's product with its router weight into its slot: the
        ops `ExpertOutputs.compute` runs per expert, without its grouping (the same values, bit for bit)."""
        if x.shape[0] != 1:
            return False
        for expert_tensors, slot in zip(tensors, slots, strict=True):
            weigh_into(self(x, expert_tensors), weights, slot, buffer)
        return True

    def many(self, x: torch.Tensor, tensors: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor | None:
        """One `bmm` per projection over stacked weights, where that equals `F.linear` per expert."""
        if x.dtype not in BATCHED_EXACT_DTYPES or x.device.type != "cpu" or self.is_transposed \
                or self.post_norm is not None:
            return None
        up_name = "gate_up_proj" if self.has_gate else "up_proj"
        up = torch.stack([t[up_name] for t in tensors])  # [G, 2I or I, H]
        h = torch.bmm(x, up.transpose(1, 2))  # [G, n, 2I] or [G, n, I]
        if self.has_bias:
            h = h + torch.stack([t[f"{up_name}_bias"] for t in tensors]).unsqueeze(1)
        flat = h.reshape(-1, h.shape[-1])  # the gate is elementwise over rows
        h = (self.apply_gate(flat) if self.has_gate else self.act(flat)).view(*h.shape[:2], -1)  # [G, n, I]
        out = torch.bmm(h, torch.stack([t["down_proj"] for t in tensors]).transpose(1, 2))  # [G, n, H]
        if self.has_bias:
            out = out + torch.stack([t["down_proj_bias"] for t in tensors]).unsqueeze(1)
        return out


@dataclass(frozen=True)
class DenseActDenseKernel(ExpertKernel):
    """Switch Transformers experts: `wo(act(wi(x)))` (dropout is the identity at inference)."""

    stable = True  # HF's loop takes an expert's tokens from `torch.where`, in increasing order
    act: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        wo = tensors["wo.weight"]
        h = self.act(F.linear(x, tensors["wi.weight"]))  # [n, d_ff]
        return F.linear(h.to(wo.dtype), wo)  # [n, d_model]


class Dispatch:
    """One layer's (token, slot) pairs grouped by expert, each group's rows in the reference's order.

    The rows of an expert are positions `token * k + slot` of the flattened `top_k_index` [T, k]. Their
    order inside a group matters in float32: a CPU matmul's result for one row depends on where the row
    falls in the kernel's row blocks. HF's `grouped_mm` path orders them with `torch.sort(expert_ids)`
    (its default, unstable); the per-expert loops (Switch) take tokens in increasing order (`stable`).
    Indices outside `[0, num_experts)` (a token dropped by Switch's capacity) belong to no group.
    """

    def __init__(self, top_k_index: torch.Tensor, num_experts: int, *, stable: bool = False) -> None:
        self.tokens, self.top_k = top_k_index.shape
        self.groups: dict[int, tuple[int, int]] = {}
        """expert -> (start, end) in `order`, experts in increasing id order."""
        self.slot_of: dict[int, int] | None = None
        """With one token routed to distinct experts (a decoded row): expert -> its slot, the one row of its
        group (`ExpertOutputs` then keeps outputs in slot order); else None."""
        self.ids: list[int] | None = None
        """With `slot_of`: the token's expert ids in slot order (as routed, -1 for a dropped token)."""
        self.token_of: torch.Tensor | None = None
        """[S] the token of each sorted row (HF's perm // k); None with `slot_of` (the one token's)."""
        self._inverse: torch.Tensor | None = None
        self._order: torch.Tensor | None = None
        self._device = top_k_index.device
        if self.tokens == 1 and self._one_token(top_k_index, num_experts):
            return
        flat = top_k_index.reshape(-1)  # [S = T*k]
        sorted_ids, self._order = torch.sort(flat, stable=True) if stable else torch.sort(flat)  # [S]
        self.token_of = self._order // self.top_k
        ids, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
        start = 0
        for expert, count in zip(ids.tolist(), counts.tolist(), strict=True):
            if 0 <= expert < num_experts:
                self.groups[expert] = (start, start + count)
            start += count

    def _one_token(self, top_k_index: torch.Tensor, num_experts: int) -> bool:
        """The groups of one token's k distinct experts in Python (the sort of k distinct ids has one
        answer, stable or not): a decoded row's few torch ops cost more than the sort itself."""
        ids = top_k_index.reshape(-1).tolist()
        if len(set(ids)) != len(ids):
            return False
        self.ids = ids
        self._slots = sorted(range(len(ids)), key=ids.__getitem__)  # the slot at each sorted position
        self.slot_of = {}
        for position, slot in enumerate(self._slots):
            if 0 <= ids[slot] < num_experts:
                self.groups[ids[slot]] = (position, position + 1)
                self.slot_of[ids[slot]] = slot
        return True

    @property
    def order(self) -> torch.Tensor:
        """[S]: the flat (token, slot) position of each sorted row (made on first use for one token,
        whose decode step needs it only under expert parallelism)."""
        if self._order is None:
            self._order = torch.tensor(self._slots, device=self._device)
        return self._order

    def rows(self, expert: int) -> torch.Tensor:
        """The flat (token, slot) positions routed to `expert` [n]."""
        start, end = self.groups[expert]
        return self.order[start:end]

    @property
    def inverse(self) -> torch.Tensor:
        """[S]: where each flat (token, slot) position sits in `order`."""
        if self._inverse is None:
            self._inverse = torch.empty_like(self.order)
            self._inverse[self.order] = torch.arange(self.order.numel(), device=self.order.device)
        return self._inverse


class ExpertOutputs:
    """The weighted outputs of one layer's experts, kept per (token, slot) and summed as HF sums them.

    Mirrors `grouped_mm_experts_forward`: the routed states are gathered once in `Dispatch` order (HF's
    `selected_hidden_states_g`), each expert runs on its contiguous slice of them and multiplies by its
    router weights into its slice of one `[S, H]` buffer, in any order (as experts become resident).
    `result` puts the rows back in (token, slot) order and reduces them with HF's own op,
    `view(T, k, H).sum(dim=1)` (one reduction over the k slots of a token, in slot order, accumulated in
    float32 and rounded once), then casts to the hidden states' dtype. For top-1 (Switch, whose HF loop
    uses `index_add_` into zeros) the one-slot sum is that slot's value, the same as adding it to zero.
    """

    def __init__(self, hidden_states: torch.Tensor, top_k_weights: torch.Tensor, dispatch: Dispatch) -> None:
        self.hidden_states = hidden_states  # [T, H]
        self.dispatch = dispatch
        self.one_token = dispatch.slot_of is not None
        """A decoded row (`Dispatch.slot_of`): every expert's row is the token itself, and outputs are kept
        in slot order, so no gather, no sorted weights and no scatter back."""
        if self.one_token:
            self._states = hidden_states.expand(dispatch.top_k, -1)  # [k, H], a view of the one row
            self._weights = top_k_weights.reshape(-1, 1)  # [k, 1] in slot order
        else:
            self._states = hidden_states[dispatch.token_of]  # [S, H] routed states, sorted by expert
            self._weights = top_k_weights.reshape(-1)[dispatch.order].unsqueeze(-1)  # [S, 1], sorted
        self._outputs: torch.Tensor | None = None
        """[S, H] weighted outputs once one is known: sorted by expert, or in slot order (`one_token`)."""

    def compute(self, expert: int, kernel: ExpertKernel, tensors: dict[str, torch.Tensor]) -> None:
        """Run `expert` on its tokens and keep its weighted outputs (the product HF takes, in its dtype)."""
        start, end = self.dispatch.groups[expert]
        y = kernel(self._states[start:end], tensors)  # [n, H]
        weigh_into(y, self._weights, self.dispatch.slot_of[expert] if self.one_token else start, self._buffer)

    def compute_many(self, experts: Sequence[int], kernel: ExpertKernel,
                     tensors: Sequence[dict[str, torch.Tensor]], *, stack: bool = True) -> None:
        """`compute` for several experts, in one kernel call where the kernel can (`ExpertKernel.many`)
        and `stack` allows: per-expert Python and kernel-launch costs are paid once for all the experts a
        batch needs, at the price of copying their weights into one stacked tensor."""
        if self.one_token and kernel.rows_into(self.hidden_states, tensors,
                                               [self.dispatch.slot_of[e] for e in experts], self._weights,
                                               self._buffer):
            return
        if stack and len(experts) > 1:
            spans = torch.tensor([self.dispatch.groups[e] for e in experts])  # [G, 2] (start, end)
            counts = spans[:, 1] - spans[:, 0]  # [G]
            width = int(counts.max())
            offsets = torch.arange(width)  # [n]
            valid = offsets < counts.unsqueeze(1)  # [G, n]
            # padding rows repeat each group's last row (valid indices; their outputs are dropped)
            index = spans[:, :1] + torch.minimum(offsets, counts.unsqueeze(1) - 1)  # [G, n] rows of `order`
            y = kernel.many(self._states[index], tensors)  # [G, n, H]
            if y is not None:
                rows = index[valid]  # [R] each expert's rows, expert after expert
                if self.one_token:  # their slots
                    rows = torch.tensor([self.dispatch.slot_of[e] for e in experts], device=rows.device)
                weighted = torch.mul(y[valid], self._weights[rows])  # [R, H]
                self._buffer(weighted.dtype, weighted.shape[-1])[rows] = weighted
                return
        for expert, expert_tensors in zip(experts, tensors, strict=True):
            self.compute(expert, kernel, expert_tensors)

    def put(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Store weighted outputs computed elsewhere for the flat (token, slot) positions `rows`."""
        self._buffer(values.dtype, values.shape[-1])[self._rows(rows)] = values

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        """The weighted outputs of the flat (token, slot) positions `rows` [n, H] (computed already)."""
        assert self._outputs is not None, "no expert was computed"
        return self._outputs[self._rows(rows)]

    def _rows(self, positions: torch.Tensor) -> torch.Tensor:
        """The buffer rows of flat (token, slot) positions: themselves in slot order, else where they sort."""
        return positions if self.one_token else self.dispatch.inverse[positions]

    def _buffer(self, dtype: torch.dtype, width: int) -> torch.Tensor:
        if self._outputs is None:
            # zeros: rows of no expert (a token Switch dropped) contribute nothing, as in HF
            self._outputs = self._states.new_zeros((self._states.shape[0], width), dtype=dtype)
        return self._outputs

    def result(self) -> torch.Tensor:
        """The layer's experts output [T, H]."""
        if self._outputs is None:
            return torch.zeros_like(self.hidden_states)
        if self.one_token:
            rows = self._outputs  # in (token, slot) order already
        else:
            rows = torch.empty_like(self._outputs)
            rows[self.dispatch.order] = self._outputs  # back to (token, slot) order
        tokens, top_k = self.dispatch.tokens, self.dispatch.top_k
        return rows.view(tokens, top_k, -1).sum(dim=1).to(self.hidden_states.dtype)
