"""Adapters for MoE families whose experts are not transformers' experts interface.

An adapter says, for one family, what its experts module cannot: how one expert computes (an `ExpertKernel`
over the tensors the spec stores), how the reference combines the experts' outputs (an `ExpertOutputs`), and,
where the experts module is not called as `experts(hidden_states [T, H], top_k_index [T, k],
top_k_weights [T, k])`, a replacement of the block around it that calls the offloaded experts so. Each is
installed on one model instance (`moeinf.hf.integrate.replace_experts`); nothing is patched globally.

The references, from transformers' modeling files:
- DBRX, LongCat-Flash: an eager loop over hit experts in increasing id, each expert's tokens in the order
  `torch.where` gives them on the `[k, T]` mask (slot, then token), `expert(x) * weight`, `index_add_`ed into
  zeros of the hidden dtype (one rounding per addition). LongCat-Flash's ids past the routed experts are
  zero-computation experts: the token itself times its weight.
- JetMoE: the same `index_add`, over rows sorted by `torch.sort` of the flat ids (HF's `Dispatch` order),
  then the block's output bias. Its attention experts (MoA) stay dense.
- Llama-4: every expert runs on every token (`bmm` over `[E, T, H]`), each token's input scaled by its
  sigmoid score (zero where not routed, which gives zero outputs), summed over the experts dimension.
  Here only the routed experts run, on their tokens' rows where a row's bits do not depend on the other
  rows (`BATCHED_EXACT_DTYPES` on CPU), else on all T rows (zero rows where not routed), so every row has
  the bits HF's `bmm` gives it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.moe import BATCHED_EXACT_DTYPES, Dispatch, ExpertKernel, ExpertOutputs


class SequentialOutputs(ExpertOutputs):
    """HF's eager per-expert loop: weighted rows `index_add_`ed expert after expert, in increasing id.

    `slot_major`: each expert's rows in (slot, token) order (DBRX's and LongCat's `torch.where`), else in
    `Dispatch` order (JetMoE's `torch.sort`). Ids from `identity_from` on are zero-computation experts.
    `one_add`: all experts' rows go in one `index_add` in expert order (JetMoE), not one call per expert
    (DBRX, LongCat): on CPU a reduced-precision `index_add` sums its rows in float32 and rounds once, so
    from top-3 on the two orders differ in bf16.
    """

    def __init__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 dispatch: Dispatch, *, slot_major: bool, identity_from: int | None = None,
                 one_add: bool = False) -> None:
        self.hidden_states = hidden_states  # [T, H]
        self.dispatch = dispatch
        self.one_token = False
        self.top_k_index = top_k_index  # [T, k]
        self.weights = top_k_weights.reshape(-1)  # [S]
        self.slot_major = slot_major
        self.identity_from = identity_from
        self.one_add = one_add
        self.parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """expert -> (its tokens [n], its weighted outputs [n, H]) in the reference's row order."""

    def _ordered(self, rows: torch.Tensor) -> torch.Tensor:
        if not self.slot_major:
            return rows
        k, tokens = self.dispatch.top_k, self.dispatch.tokens
        return rows[torch.argsort((rows % k) * tokens + rows // k)]  # (slot, token) order

    def compute(self, expert: int, kernel: ExpertKernel, tensors: dict[str, torch.Tensor]) -> None:
        rows = self._ordered(self.dispatch.rows(expert))  # flat (token, slot) positions [n]
        tokens = rows // self.dispatch.top_k
        y = kernel(self.hidden_states[tokens], tensors)  # [n, H]
        self.parts[expert] = (tokens, y * self.weights[rows, None])

    def compute_many(self, experts: Sequence[int], kernel: ExpertKernel,
                     tensors: Sequence[dict[str, torch.Tensor]], *, stack: bool = True) -> None:
        for expert, expert_tensors in zip(experts, tensors, strict=True):
            self.compute(expert, kernel, expert_tensors)

    def put(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        raise NotImplementedError("expert parallelism is not supported for this family")

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("expert parallelism is not supported for this family")

    def result(self) -> torch.Tensor:
        out = torch.zeros_like(self.hidden_states)
        if self.identity_from is not None:
            flat = self.top_k_index.reshape(-1)
            for expert in torch.unique(flat[flat >= self.identity_from]).tolist():
                rows = self._ordered((flat == expert).nonzero().reshape(-1))
                tokens = rows // self.dispatch.top_k
                self.parts[expert] = (tokens, self.hidden_states[tokens] * self.weights[rows, None])
        parts = [self.parts[expert] for expert in sorted(self.parts)]
        if self.one_add and parts:
            parts = [(torch.cat([tokens for tokens, _ in parts]), torch.cat([rows for _, rows in parts]))]
        for tokens, weighted in parts:
            out.index_add_(0, tokens, weighted.to(out.dtype))
        return out


class ScaledInputOutputs(ExpertOutputs):
    """Llama-4's combine: an expert's input is the token times its router score; its outputs are summed over
    the experts dimension of `[E, T, H]` (zeros where a token is not routed)."""

    def __init__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 dispatch: Dispatch, num_experts: int) -> None:
        self.hidden_states = hidden_states  # [T, H]
        self.dispatch = dispatch
        self.one_token = False
        self.top_k_index = top_k_index  # [T, k]
        self.weights = top_k_weights.reshape(-1)  # [S]
        self.num_experts = num_experts
        self.outputs_: torch.Tensor | None = None
        """[S, H] each (token, slot)'s expert output, in (token, slot) order."""

    def compute(self, expert: int, kernel: ExpertKernel, tensors: dict[str, torch.Tensor]) -> None:
        rows = self.dispatch.rows(expert)  # [n] flat (token, slot) positions
        tokens = rows // self.dispatch.top_k
        scaled = self.hidden_states[tokens] * self.weights[rows, None]  # [n, H], HF's routed_in rows
        if self.hidden_states.dtype in BATCHED_EXACT_DTYPES and self.hidden_states.device.type == "cpu":
            y = kernel(scaled, tensors)  # a row's bits do not depend on the other rows here
        else:
            x = torch.zeros_like(self.hidden_states)  # [T, H]: HF's rows of this expert, 0 where not routed
            x[tokens] = scaled
            y = kernel(x, tensors)[tokens]  # [n, H]
        if self.outputs_ is None:
            self.outputs_ = y.new_zeros((self.weights.shape[0], y.shape[-1]))
        self.outputs_[rows] = y

    def compute_many(self, experts: Sequence[int], kernel: ExpertKernel,
                     tensors: Sequence[dict[str, torch.Tensor]], *, stack: bool = True) -> None:
        for expert, expert_tensors in zip(experts, tensors, strict=True):
            self.compute(expert, kernel, expert_tensors)

    def put(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        raise NotImplementedError("expert parallelism is not supported for this family")

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("expert parallelism is not supported for this family")

    def result(self) -> torch.Tensor:
        if self.outputs_ is None:
            return torch.zeros_like(self.hidden_states)
        tokens, top_k = self.dispatch.tokens, self.dispatch.top_k
        if top_k <= 2:  # the sum over E of at most two non-zero terms: one rounding, in any order
            return self.outputs_.view(tokens, top_k, -1).sum(dim=1)
        full = self.outputs_.new_zeros((self.num_experts, tokens, self.outputs_.shape[-1]))  # HF's [E, T, H]
        token_ids = torch.arange(tokens, device=full.device).repeat_interleave(top_k)
        full[self.top_k_index.reshape(-1), token_ids] = self.outputs_
        return full.sum(dim=0)


@dataclass(frozen=True)
class GateUpKernel(ExpertKernel):
    """`down(act(gate) * up)` with gate and up one product (chunked in halves, LongCat, JetMoE), or
    `x @ gate_up` with gate_up stored [H, 2I] and down [I, H] (`transposed`, Llama-4)."""

    gate_up: str
    down: str
    act: Callable[[torch.Tensor], torch.Tensor]
    transposed: bool = False
    make_outputs: Callable[..., ExpertOutputs] | None = None

    def __call__(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.transposed:
            gate, up = (x @ tensors[self.gate_up]).chunk(2, dim=-1)  # [n, I] each
            return (up * self.act(gate)) @ tensors[self.down]  # [n, H]
        gate, up = F.linear(x, tensors[self.gate_up]).chunk(2, dim=-1)  # [n, I] each
        return F.linear(self.act(gate) * up, tensors[self.down])  # [n, H]

    def outputs(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                dispatch: Dispatch) -> ExpertOutputs:
        assert self.make_outputs is not None
        return self.make_outputs(hidden_states, top_k_index, top_k_weights, dispatch)


@dataclass(frozen=True)
class DbrxKernel(ExpertKernel):
    """DBRX's `DbrxExpertGLU`: `(act(x @ w1.T) * (x @ v1.T)) @ w2`, each [I, H] block of the fused tensors."""

    act: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        gate = self.act(x.matmul(tensors["mlp.w1"].T))  # [n, I]
        up = x.matmul(tensors["mlp.v1"].T)  # [n, I]
        return (gate * up).matmul(tensors["mlp.w2"])  # [n, H]

    def outputs(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                dispatch: Dispatch) -> ExpertOutputs:
        return SequentialOutputs(hidden_states, top_k_index, top_k_weights, dispatch, slot_major=True)


class Llama4Block(nn.Module):
    """`Llama4TextMoe` with its experts called through the experts interface: the router (kept) scores every
    expert, its top-k choice and scores route the tokens, the shared expert (kept) adds to the result."""

    def __init__(self, moe: nn.Module, experts: nn.Module) -> None:
        super().__init__()
        self.hidden_dim = moe.hidden_dim
        self.router, self.shared_expert, self.experts = moe.router, moe.shared_expert, experts

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        output = self.router(hidden_states)  # ([T, E] sigmoid of the top-k logits, 0 elsewhere; logits)
        top_k_index, top_k_weights = llama4_routing(self.router, output)
        routed = self.experts(hidden_states, top_k_index, top_k_weights)
        router_logits = output[1]
        out = self.shared_expert(hidden_states)
        out.add_(routed)
        return out, router_logits


class JetMoeBlock(nn.Module):
    """`JetMoeMoE` with its parallel experts offloaded: the router (kept) runs as in HF, its sorted routing
    is put back in (token, slot) order for the experts interface, and the block's bias is added."""

    def __init__(self, moe: nn.Module, experts: nn.Module) -> None:
        super().__init__()
        self.router, self.bias, self.experts = moe.router, moe.bias, experts

    def forward(self, layer_input: torch.Tensor) -> torch.Tensor:
        bsz, length, emb_size = layer_input.size()
        layer_input = layer_input.reshape(-1, emb_size)
        top_k_index, top_k_weights = jetmoe_routing(self.router, self.router(layer_input))
        out = self.experts(layer_input, top_k_index, top_k_weights)
        return out.view(bsz, length, emb_size) + self.bias


def jetmoe_routing(router: nn.Module, output: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """`JetMoeTopKGating`'s output (rows sorted by expert) as (top_k_index, top_k_weights) [T, k]."""
    index_sorted, _, batch_gates, expert_size, _ = output
    experts = torch.arange(len(expert_size), device=index_sorted.device)
    flat_ids = torch.empty_like(index_sorted)
    flat_ids[index_sorted] = experts.repeat_interleave(torch.tensor(expert_size, device=experts.device))
    gates = torch.empty_like(batch_gates)
    gates[index_sorted] = batch_gates
    return flat_ids.view(-1, router.top_k), gates.view(-1, router.top_k)


def llama4_routing(router: nn.Module, output: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """`Llama4Router`'s output (sigmoid scores [T, E], logits) as (top_k_index, top_k_weights) [T, k]."""
    router_scores, router_logits = output
    top_k_index = torch.topk(router_logits, router.top_k, dim=1).indices  # the router's own choice
    return top_k_index, router_scores.gather(1, top_k_index)


@dataclass(frozen=True)
class Adapter:
    """One family's adapter: `kernel(experts module)`, and `block(original site module, offloaded experts)`
    where the offloaded experts need a block around them (else they replace the site module itself)."""

    kernel: Callable[[nn.Module], ExpertKernel]
    block: Callable[[nn.Module, nn.Module], nn.Module] | None = None
    parent: bool = False
    """The block replaces the site's parent (Llama-4: the experts' MoE block), not the site module."""
    router: str | None = None
    """Where the unmodified model's routing is read, when its experts module is not called with it: the
    router module's path under the block (`routing` turns its input and output into the experts' call)."""
    routing: Callable[[nn.Module, tuple], tuple[torch.Tensor, torch.Tensor]] | None = None


def _longcat(module: nn.Module) -> ExpertKernel:
    outputs = partial(SequentialOutputs, slot_major=True, identity_from=module.num_routed_experts)
    return GateUpKernel("gate_up_proj", "down_proj", module.act_fn, make_outputs=outputs)


def _jetmoe(module: nn.Module) -> ExpertKernel:
    outputs = partial(SequentialOutputs, slot_major=False, one_add=True)
    return GateUpKernel("input_linear.weight", "output_linear.weight", module.activation,
                        make_outputs=outputs)


def _llama4(module: nn.Module) -> ExpertKernel:
    outputs = partial(ScaledInputOutputs, num_experts=module.num_experts)
    return GateUpKernel("gate_up_proj", "down_proj", module.act_fn, transposed=True, make_outputs=outputs)


ADAPTERS: dict[str, Adapter] = {
    "dbrx": Adapter(lambda module: DbrxKernel(module.mlp.activation_fn)),
    "jetmoe": Adapter(_jetmoe, block=JetMoeBlock, router="router", routing=jetmoe_routing),
    "llama4": Adapter(_llama4, block=Llama4Block, parent=True, router="router", routing=llama4_routing),
    "longcat": Adapter(_longcat),
}
"""`ArchSpec.adapter` -> its adapter."""
