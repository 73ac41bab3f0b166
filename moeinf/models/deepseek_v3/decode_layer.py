"""A quantised store's DeepSeek-V3 decoder layer, one decoded row at a time, as one flat function.

With the dense parts already in moeinf's kernels (`norms`, `mla_decode`, `routers`, `quant_dense`), a decoded
row of the e2e model spent about as long in Python around the calls as in them: ~11 module calls per layer
(each `nn.Module.__call__` with its hook checks, each sub-module an `nn.Module.__getattr__`), transformers'
decorators on the layer's forward, the MoE block's reshapes and every replaced module's own checks, at
5-10 us each inside a token (the ~100 MB of weights a token streams leave the interpreter's working set
cold). `OneRowDecode` is such a layer's forward; a one-row decode step on a cache runs the same kernel
calls in the same order, on arguments bound when the layer is first decoded, and returns what the layer's
own forward returns, bit for bit. Everything else (prefill, batches, another dtype or device, a mask that
is not boolean, `output_attentions`) runs the layer's own forward, as does a layer with a hook on any of
its parts, which the flat function would not run (`_Bound.hooked`). A layer whose parts were replaced is
bound again (`_Bound.current`).
"""

from __future__ import annotations

import operator
from functools import partial
from typing import Any

import torch
from torch import nn

from ... import _kernels
from ...kernels import gemv
from ...kernels.gemv import DTYPES
from ...kernels.norms import FusedRMSNorm
from ...kernels.quant_experts import bound_row_product
from ...kernels.quant_linear import FusedGatedMLP, QuantisedLinear
from ...runtime.experts import OffloadedExperts
from .mla_decode import AbsorbedMLADecode
from .router import GroupFreeTopkRouter


def _row(module: nn.Module) -> tuple[Any, int, int] | None:
    """A linear's bound one-row product (`gemv.RowProduct`, of its current buffers), its out and in widths;
    None where the module is not a `QuantisedLinear` without bias whose GEMV runs."""
    if type(module) is not QuantisedLinear or module.bias is not None:
        return None
    row = module.row_product()
    return None if row is None else (row, row.rows, row.cols)


GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks")
"""torch's hooks on every module's call (`register_module_forward_hook`), which the flat function skips."""


FUSED_ROWS_MULTIPLE = 32
"""The first linear's rows must be a multiple of this to share a product with the second: the kernels walk
rows in groups (4 int8 rows, 32-row int4 blocks), and each row then sits where its own product put it."""


def _fused(first: nn.Module, second: nn.Module) -> tuple[Any, int] | None:
    """One bound product of two int8 `QuantisedLinear`s of the same input, their weights stacked (the first's
    rows, then the second's), and the first's width; None where they do not stack. The two modules' buffers
    become views of the stacked ones, so nothing is stored twice (DeepSeek-V3's q_a and kv_a projections are
    ~15 MB per layer in int8) and an in-place write to either reaches the product. Each output row is its own
    weight row's sum over the same input row, so the stacked product gives each the bits its own product
    gives (the layer's forward and the flat function are compared bit for bit in the tests)."""
    rows = [_row(first), _row(second)]
    if None in rows or any(m.quant.scheme != "int8" for m in (first, second)) \
            or first.int8_activations != second.int8_activations or rows[0][2] != rows[1][2] \
            or rows[0][1] % FUSED_ROWS_MULTIPLE:
        return None
    qweight = torch.cat([first.qweight, second.qweight])
    scales = torch.cat([first.scales, second.scales])
    product = bound_row_product(qweight, scales, first.quant, (rows[0][1] + rows[1][1], rows[0][2]),
                                int8_activations=first.int8_activations)
    if product is None:
        return None
    width = rows[0][1]
    first.qweight, first.scales = qweight[:width], scales[:width]  # contiguous row ranges of the stack
    second.qweight, second.scales = qweight[width:], scales[width:]
    return product, width


class PartsCheck:
    """What a layer's flat decode function checks at every call: each part it bound still in its parent's
    dict under its name (`current`), and no forward hook that it would not run (`hooked`). Subclasses set
    `dicts`, `names` and `values` (each part's parent dict, name and the part) and `hooks` (the parts' hook
    dicts)."""

    dicts: list[dict]
    names: list[str]
    values: list[Any]
    hooks: list[dict]

    def current(self) -> bool:
        """The parts bound are still the layer's (lookups in C: this runs at every decoded row of every
        layer)."""
        return all(map(operator.is_, map(dict.get, self.dicts, self.names), self.values))

    def hooked(self) -> bool:
        """A part, or every module, has a forward hook that the flat function would not run."""
        module = torch.nn.modules.module
        return any(map(bool, self.hooks)) or any(getattr(module, name, None) for name in GLOBAL_HOOKS)


class _Bound(PartsCheck):
    """The arguments of one layer's flat decode step, read from its parts once (`bind`), and the parts
    themselves to check that they are still the layer's, unhooked (`current`)."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.dtype, self.type = dtype, DTYPES[dtype]
        self.attn = attn
        inner = attn.inner
        self.norms = layer.input_layernorm, layer.post_attention_layernorm, inner.kv_a_layernorm
        self.hidden = int(self.norms[0].shape[0])
        lora = inner.q_lora_rank is not None
        self.first = _fused(inner.q_a_proj if lora else inner.q_proj, inner.kv_a_proj_with_mqa)
        """The first q projection and `kv_a_proj_with_mqa` (both of the normed row) as one product, and the
        first's width; or None: two products. First: the bound products below take the views it leaves."""
        self.q = _row(inner.q_b_proj if lora else inner.q_proj)
        self.q_a = _row(inner.q_a_proj) if lora else None
        """With a q LoRA (DeepSeek-V3's): `q_a_proj`, then its norm (`norms[3]`), then `q_b_proj` (`q`)."""
        self.kv_a = _row(inner.kv_a_proj_with_mqa)
        self.o = _row(inner.o_proj)
        gate, shared = mlp.gate, mlp.shared_experts
        self.gate, self.experts, self.shared_module = gate, mlp.experts, shared
        kernel_router = type(gate) is GroupFreeTopkRouter and gate.one_row_kernel
        self.router = gate._row_arguments() if kernel_router else None
        """The router's kernels' arguments, or None: a router of another kind runs its own forward."""
        fused = type(shared) is FusedGatedMLP and shared.silu
        self.shared = (_row(shared.gate_up_proj), _row(shared.down_proj)) if fused else None
        """The shared expert's bound products, or None: it runs its own forward."""
        if self.shared is not None and None in self.shared:
            self.shared = None
        names = ["kv_a_layernorm", "kv_a_proj_with_mqa", "o_proj",
                 *(["q_a_proj", "q_a_layernorm", "q_b_proj"] if lora else ["q_proj"])]
        children = [(layer, "self_attn"), (layer, "mlp"), (layer, "input_layernorm"),
                    (layer, "post_attention_layernorm"), (attn, "inner"), *((inner, name) for name in names),
                    (mlp, "gate"), (mlp, "experts"), (mlp, "shared_experts")]
        if self.shared is not None:
            children += [(shared, "gate_up_proj"), (shared, "down_proj")]
        entries = [(parent._modules, name, parent._modules[name]) for parent, name in children]
        parts = [child for _, _, child in entries]  # the layer's own hooks run: its `__call__` calls us
        if lora:
            self.norms += (inner.q_a_layernorm,)
        entries += [(norm._parameters, "weight", norm.weight) for norm in self.norms]
        rows = [inner.q_b_proj if lora else inner.q_proj, inner.kv_a_proj_with_mqa, inner.o_proj,
                *([inner.q_a_proj] if lora else []),
                *([shared.gate_up_proj, shared.down_proj] if self.shared is not None else [])]
        if any(name not in m._buffers for m in rows for name in ("qweight", "scales")):
            self.ok = False  # a projection left unquantised (attention_linears "model"): its own forward
            return
        entries += [(m._buffers, name, m._buffers[name]) for m in rows for name in ("qweight", "scales")]
        self.dicts, self.names, self.values = (list(column) for column in zip(*entries, strict=True))
        """What `current` looks up: each part and bound tensor in its parent's dict, under its name."""
        self.hooks = [hooks for part in parts for hooks in (part._forward_hooks, part._forward_pre_hooks)]
        self.norm_weights = [norm.weight.contiguous() for norm in self.norms]
        self.eps = [norm.eps for norm in self.norms]
        self.ok = (None not in (self.q, self.kv_a, self.o) and (self.q_a is not None or not lora)
                   and all(w.dtype == dtype and w.device.type == "cpu" for w in self.norm_weights))
        if not self.ok:
            return
        # the step's intermediates that stay inside it, allocated once (a few us each inside a token); what
        # leaves the step (the cache's new rows, the routing, the output) is new at every step
        hidden, new = self.hidden, partial(torch.empty, dtype=dtype)
        self.normed = new(1, 1, hidden), new(1, 1, hidden)
        self.routed_in = self.normed[1].view(1, hidden)  # the experts' [T, H] view of the MoE block's input
        self.q_row, self.latent = new(1, self.q[1]), new(1, self.kv_a[1])
        if self.first is not None:  # the two products' outputs: views of one
            self.both = new(1, self.first[0].rows)
            first_width = self.first[1]
            self.latent = self.both[:, first_width:]
            if lora:
                self.first_out = self.both[:, :first_width]
            else:
                self.q_row = self.both[:, :first_width]
        self.q_out = torch.empty(attn.heads, attn.nope + attn.rope)  # float32
        self.attended, self.attention = new(1, attn.heads * attn.v_dim), new(1, 1, self.o[1])
        self.residual = new(1, 1, hidden)
        self.q_lora = (new(1, self.q_a[1]), new(1, self.q_a[1])) if lora else None
        self.logits = torch.empty(1, self.router[4]) if self.router is not None else None  # float32
        self.shared_out = new(1, 1, self.shared[1][1]) if self.shared is not None else None


class FlatForward:
    """The `forward` of one decoder layer (`layer`): where `_bind` finds the call to be a step its flat
    function serves, `decode` with what it bound; everything else the layer's own forward.

    Set on the layer instance rather than wrapping it in another module: a wrapper would move every part
    under a new name (`layers.0.inner.mlp...`) and hide the layer's attributes (`layers[0].mlp`), which
    state dicts, hooks by name and research code rely on. The layer's own hooks run as before (its
    `__call__` calls this), so `output_hidden_states` records the flat function's output."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        self.own = type(layer).forward
        """The layer's own forward (its class's, with transformers' decorators), called with the layer."""
        self._bound: Any = None

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        bound = self._bind(hidden_states, args, kwargs)
        if bound is None:
            return self.own(self.layer, hidden_states, *args, **kwargs)
        return self.decode(bound, hidden_states, kwargs)

    def _bind(self, hidden_states: torch.Tensor, args: tuple, kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def decode(self, bound: Any, hidden_states: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError


class OneRowDecode(FlatForward):
    """The `forward` of one DeepSeek-V3 decoder layer of a quantised store whose parts moeinf replaced: a
    decoded row on a cache runs as one flat function (module docstring), everything else as the layer's own
    forward."""

    def _bind(self, hidden_states: torch.Tensor, args: tuple, kwargs: dict[str, Any]) -> _Bound | None:
        """The bound arguments where this call is a one-row decode step they serve, else None."""
        if args or hidden_states.numel() != hidden_states.shape[-1] or hidden_states.dim() != 3:
            return None
        cache, mask = kwargs.get("cache", kwargs.get("past_key_values")), kwargs.get("attention_mask")
        position = kwargs.get("position_embeddings")
        if cache is None or position is None or kwargs.get("output_attentions") \
                or (mask is not None and mask.dtype != torch.bool):
            return None
        dtype = hidden_states.dtype
        bound = self._bound
        if bound is None or bound.dtype != dtype or not bound.current():
            bound = self._bound = None
            if dtype in DTYPES and gemv.available() and fits(self.layer):
                # normal tensors even when first decoded under inference mode: its buffers and the linears'
                # stacked weights are written again later, maybe outside it
                with torch.inference_mode(False):
                    bound = _Bound(self.layer, dtype)
                self._bound = bound if bound.ok else None
            bound = self._bound
        if bound is None or bound.hooked() or hidden_states.device.type != "cpu" \
                or not hidden_states.is_contiguous() or hidden_states.shape[-1] != bound.hidden:
            return None
        cos, sin = position
        if cos.dtype != dtype or sin.dtype != dtype:
            return None
        return bound

    def decode(self, bound: _Bound, hidden_states: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        """The layer's output [1, 1, H] for one decoded row: `inner`'s computation, step for step, with the
        kernels that its parts call on one row, in the same order."""
        kind, pool, hidden = bound.type, gemv._pool(), bound.hidden
        attn = bound.attn
        # input norm, then the attention's projections of the normed row
        normed = bound.normed[0]
        _kernels.rms_norm(hidden_states.data_ptr(), bound.norm_weights[0].data_ptr(), bound.eps[0], kind, 1,
                          hidden, normed.data_ptr())
        q, latent, source = bound.q_row, bound.latent, normed
        if bound.first is not None:  # the first q projection and the latent's in one product
            _kernels.row_weight_product(normed.data_ptr(), kind, 1, bound.first[0].weight,
                                        bound.both.data_ptr(), pool)
        if bound.q_lora is not None:  # q_a_proj, its norm, then q_b_proj
            compressed, source = bound.q_lora
            if bound.first is None:
                _kernels.row_weight_product(normed.data_ptr(), kind, 1, bound.q_a[0].weight,
                                            compressed.data_ptr(), pool)
            else:
                compressed = bound.first_out
            _kernels.rms_norm(compressed.data_ptr(), bound.norm_weights[3].data_ptr(), bound.eps[3], kind, 1,
                              bound.q_a[1], source.data_ptr())
        if bound.q_lora is not None or bound.first is None:  # else `first` computed q_proj already
            _kernels.row_weight_product(source.data_ptr(), kind, 1, bound.q[0].weight, q.data_ptr(), pool)
        if bound.first is None:
            _kernels.row_weight_product(normed.data_ptr(), kind, 1, bound.kv_a[0].weight, latent.data_ptr(),
                                        pool)
        attended, attention = bound.attended, bound.attention
        attn.attend_latent(q, latent, kwargs["position_embeddings"], kwargs.get("attention_mask"),
                           kwargs.get("cache", kwargs.get("past_key_values")), kwargs, bound.norm_weights[2],
                           bound.eps[2], bound.q_out, attended)
        _kernels.row_weight_product(attended.data_ptr(), kind, 1, bound.o[0].weight, attention.data_ptr(),
                                    pool)
        residual = torch.add(hidden_states, attention, out=bound.residual)
        # post-attention norm, router, routed and shared experts
        normed = bound.normed[1]
        _kernels.rms_norm(residual.data_ptr(), bound.norm_weights[1].data_ptr(), bound.eps[1], kind, 1,
                          hidden, normed.data_ptr())
        if bound.router is None:
            _, top_k_weights, top_k_index = bound.gate.forward(normed)
        else:
            weight, weight_type, bias, bias_type, experts, _, k, norm, scaling = bound.router
            logits = bound.logits
            _kernels.dense_row_product(normed.data_ptr(), kind, weight, weight_type, experts, hidden,
                                       logits.data_ptr(), pool)
            top_k_weights = torch.empty(1, k)
            top_k_index = torch.empty(1, k, dtype=torch.long)
            _kernels.sigmoid_topk(logits.data_ptr(), bias, bias_type, experts, k, norm, scaling,
                                  top_k_weights.data_ptr(), top_k_index.data_ptr())
        routed = bound.experts.forward(bound.routed_in, top_k_index, top_k_weights)  # [1, H]
        if bound.shared is None:
            shared = bound.shared_module.forward(normed)
        else:
            (gate_up, _, _), (down, _, _) = bound.shared
            shared = bound.shared_out
            _kernels.gated_rows(normed.data_ptr(), kind, [(gate_up.weight, down.weight, 0)], 0, kind,
                                shared.data_ptr(), kind, pool)
        return residual + (routed + shared)  # [1, H] + [1, 1, H]: HF's sums, broadcast to [1, 1, H]


def fits(layer: nn.Module) -> bool:
    """A DeepSeek-V3 MoE decoder layer whose parts `OneRowDecode.decode` replays: moeinf's fused norms,
    absorbed MLA decode and offloaded experts (whether its linears, router and shared expert take the
    kernels module's calls or their own forward is decided when bound)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3MoE

    if type(layer) is not DeepseekV3DecoderLayer:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not AbsorbedMLADecode or type(mlp) is not DeepseekV3MoE:
        return False
    inner = attn.inner
    norms = [layer.input_layernorm, layer.post_attention_layernorm, inner.kv_a_layernorm]
    if inner.q_lora_rank is not None:
        norms.append(inner.q_a_layernorm)
    return (all(type(norm) is FusedRMSNorm for norm in norms) and isinstance(mlp.experts, OffloadedExperts)
            and bool(inner.config.rope_interleave) == attn.interleave)


def flatten_decode_layers(model: nn.Module) -> list[str]:
    """Give each decoder layer of `model` that `fits` a `OneRowDecode` as its forward; their names."""
    targets = [name for name, module in model.named_modules() if fits(module)]
    for name in targets:
        layer = model.get_submodule(name)
        layer.forward = OneRowDecode(layer)
    return targets


def flat_decode(layer: nn.Module) -> OneRowDecode | None:
    """The layer's `OneRowDecode`, if `flatten_decode_layers` gave it one."""
    forward = layer.__dict__.get("forward")
    return forward if isinstance(forward, OneRowDecode) else None
