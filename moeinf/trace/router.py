"""Router tracing on an unmodified HuggingFace MoE model, per instance.

`RouterTracer(model)` registers forward pre-hooks on that model instance only (removed by `close`):

- on every experts module (the modules matching the family's `ArchSpec.experts_module`, in
  `named_modules()` order: that order defines the MoE-layer ordinal `0..L-1`), it reads the routing the
  MoE block hands to its experts. Families on transformers' experts interface call
  `experts(hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k])`; Switch Transformers calls
  `experts(hidden_states [N, H], one_hot [N, 1, E], router_probs [N, 1])`, where a token dropped by the
  expert capacity has an all-zero one-hot row (recorded as expert -1, i.e. no expert);
- on the module that receives the attention mask for those experts (the top model for decoder-only
  models; the encoder and decoder stacks of an encoder-decoder), it reads the batch size and the 2-D
  attention mask of each forward, so padding tokens are excluded and each sequence gets its own EAM.

Each forward of such a stack is one *step* (prefill, then one per decoded token; for an encoder-decoder
the encoder pass is a step of its own). The hooks only read tensors: traced outputs equal untraced ones.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..hf.adapters import ADAPTERS
from ..spec import spec_for
from .eam import add_tokens, empty_eam


@dataclass
class StepRouting:
    """The routing of one forward of one stack, for a whole batch."""

    stack: str
    """"" (decoder-only model), "encoder" or "decoder"."""
    batch: int
    mask: torch.Tensor | None
    """The 2-D attention mask `[B, past + T]` passed to the stack (None = every token is real)."""
    layers: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    """MoE layer -> (expert ids `[B, T, k]` int64 with -1 = no expert, gate weights `[B, T, k]` float32,
    valid `[B, T]` bool)."""
    hidden: dict[int, np.ndarray] = field(default_factory=dict)
    """MoE layer -> the router input `[B, T, H]` float32 (only when the tracer records hidden states)."""


SequenceStep = dict[int, tuple[np.ndarray, np.ndarray]]
"""One step of one sequence: MoE layer -> (expert ids `[T, k]`, gate weights `[T, k]`) of its real tokens."""


class RouterTracer:
    """Records the routing of every MoE layer of one model instance; a context manager."""

    def __init__(self, model: torch.nn.Module, *, hidden: bool = False) -> None:
        config = model.config
        self.record_hidden = hidden
        """Also keep every MoE layer's router input (what the learned look-ahead predictor is fit on)."""
        self.spec = spec_for(config.model_type)
        self.num_experts = self.spec.num_experts(config)
        self.top_k = self.spec.top_k(config)
        pattern = re.compile(self.spec.experts_module)
        self.module_names = [name for name, _ in model.named_modules() if pattern.fullmatch(name)]
        if not self.module_names:
            raise ValueError(f"no experts module matching {self.spec.experts_module!r} in this "
                             f"{config.model_type} model; fix the ArchSpec in moeinf/spec.py")
        self.num_layers = len(self.module_names)
        if self.spec.task == "seq2seq-lm":
            stacks = {"encoder": model.get_encoder(), "decoder": model.get_decoder()}
        else:
            stacks = {"": model}
        self.generating_stack = "decoder" if self.spec.task == "seq2seq-lm" else ""
        self.steps: list[StepRouting] = []
        self._current: dict[str, StepRouting] = {}
        self._handles: list[Any] = []
        for name, stack in stacks.items():
            self._handles.append(stack.register_forward_pre_hook(
                functools.partial(self._on_stack, name, _parameter_names(stack)), with_kwargs=True))
        modules = dict(model.named_modules())
        adapter = ADAPTERS.get(self.spec.adapter)
        for layer, name in enumerate(self.module_names):
            stack = next(s for s in stacks if s == "" or name.startswith(s + "."))
            module = modules[name]
            if adapter is not None and adapter.router is not None:
                # the experts are not called with the routing (Llama-4, JetMoE): read it from the router
                block = name.rpartition(".")[0] if adapter.parent else name
                routing = functools.partial(self._on_router, layer, stack, adapter.routing)
                self._handles.append(modules[f"{block}.{adapter.router}"].register_forward_hook(routing))
                continue
            hook = functools.partial(self._on_experts, layer, stack, _parameter_names(module))
            self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def __enter__(self) -> RouterTracer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove every hook from the model."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reset(self) -> None:
        """Forget recorded steps (call before each new batch)."""
        self.steps.clear()
        self._current.clear()

    # -- hooks ------------------------------------------------------------------------------------

    def _on_stack(self, stack: str, names: list[str], module: torch.nn.Module, args: tuple,
                  kwargs: dict[str, Any]) -> None:
        values = dict(zip(names, args, strict=False), **kwargs)
        mask = values.get("attention_mask")
        inputs = values.get("input_ids")
        if inputs is None:
            inputs = values.get("inputs_embeds")
        if inputs is None:
            raise ValueError("router tracing needs input_ids or inputs_embeds in the model's forward")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            raise ValueError("router tracing needs a 2-D attention_mask [batch, length] (or none); got "
                             f"{type(mask).__name__} {getattr(mask, 'shape', '')}")
        step = StepRouting(stack, int(inputs.shape[0]), mask)
        self._current[stack] = step
        self.steps.append(step)

    def _on_experts(self, layer: int, stack: str, names: list[str], module: torch.nn.Module, args: tuple,
                    kwargs: dict[str, Any]) -> None:
        values = dict(zip(names, args, strict=False), **kwargs)
        self._record(layer, stack, *(values[n] for n in names[:3]))

    def _on_router(self, layer: int, stack: str, routing: Any, module: torch.nn.Module, args: tuple,
                   output: Any) -> None:
        self._record(layer, stack, args[0], *routing(module, output))

    def _record(self, layer: int, stack: str, hidden: torch.Tensor, routing: torch.Tensor,
                weights: torch.Tensor) -> None:
        step = self._current.get(stack)
        if step is None:
            raise RuntimeError("an experts module ran outside a forward of the traced model; call the "
                               "model (or generate) rather than its submodules while tracing")
        hidden = hidden.reshape(-1, hidden.shape[-1])  # [N, H] with N = B * T (DBRX passes [B, T, H])
        tokens = hidden.shape[0]
        batch = step.batch
        if tokens % batch:
            raise RuntimeError(f"experts of layer {layer} got {tokens} tokens for a batch of {batch}")
        length = tokens // batch
        with torch.no_grad():
            if self.spec.adapter == "switch":  # one-hot [N, 1, E], all zero when dropped by capacity
                ids = routing.argmax(dim=-1).masked_fill(routing.sum(dim=-1) == 0, -1)  # [N, 1]
            else:  # [N, k]; LongCat-Flash's zero-computation experts (ids past E) are no expert
                ids = routing.masked_fill(routing >= self.num_experts, -1)
            ids_np = ids.reshape(batch, length, -1).to("cpu", torch.int64).numpy()
            weights_np = weights.detach().reshape(batch, length, -1).to("cpu", torch.float32).numpy()
            if step.mask is None:
                valid = np.ones((batch, length), dtype=bool)
            else:
                valid = (step.mask[:, -length:] != 0).cpu().numpy()
            if self.record_hidden:
                states = hidden.detach().reshape(batch, length, -1)  # [B, T, H]
                step.hidden[layer] = states.to("cpu", torch.float32).numpy()
        step.layers[layer] = (ids_np, weights_np, valid)

    # -- results ----------------------------------------------------------------------------------

    def _kept_steps(self, generated: int | None) -> Iterator[StepRouting]:
        """The steps a sequence's record keeps: `generated` (see `sequence_steps`) bounds the generating
        stack's steps; every step of the other stack is kept."""
        decoded = 0
        for step in self.steps:
            if step.stack == self.generating_stack:
                decoded += 1
                if generated is not None and decoded > max(generated, 1):
                    continue
            yield step

    def sequence_steps(self, index: int, generated: int | None = None) -> list[SequenceStep]:
        """The steps of sequence `index` of the batch, real tokens only.

        `generated`: how many tokens generate() produced for it, up to and including its first EOS.
        Steps of the generating stack from that number on ran only because other sequences of the
        batch were still going (the sequence was already finished) and are dropped, so the result
        equals tracing the sequence alone. None keeps every step.
        """
        out: list[SequenceStep] = []
        for step in self._kept_steps(generated):
            seq: SequenceStep = {}
            for layer, (ids, weights, valid) in sorted(step.layers.items()):
                keep = valid[index]
                seq[layer] = (ids[index][keep], weights[index][keep])
            out.append(seq)
        return out

    def sequence_hidden(self, index: int, generated: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Sequence `index`'s real tokens over its steps (as `sequence_steps`): router inputs `[N, L, H]`
        and expert ids `[N, L, k]`. Needs `hidden=True`; steps that did not run every MoE layer (an
        encoder-decoder's two stacks) are skipped, a token must be seen by all L layers."""
        if not self.record_hidden:
            raise RuntimeError("RouterTracer(model, hidden=True) records router inputs; this one does not")
        hidden, ids = [], []
        for step in self._kept_steps(generated):
            if sorted(step.hidden) != list(range(self.num_layers)):
                continue
            keep = step.layers[0][2][index]  # [T] real tokens (the same mask for every layer of a step)
            hidden.append(np.stack([step.hidden[layer][index][keep] for layer in range(self.num_layers)], 1))
            ids.append(np.stack([step.layers[layer][0][index][keep] for layer in range(self.num_layers)], 1))
        if not hidden:
            return np.zeros((0, self.num_layers, 0), np.float32), np.zeros((0, self.num_layers, self.top_k),
                                                                            np.int64)
        return np.concatenate(hidden), np.concatenate(ids)

    def eams(self, generated: list[int] | None = None) -> np.ndarray:
        """`[B, L, E]`: the EAM of every sequence of the batch (see `sequence_steps` for `generated`)."""
        batch = self.steps[0].batch if self.steps else 0
        out = np.zeros((batch, self.num_layers, self.num_experts), dtype=np.float32)
        for b in range(batch):
            out[b] = steps_eam(self.sequence_steps(b, None if generated is None else generated[b]),
                               self.num_layers, self.num_experts)
        return out


def generated_lengths(new_tokens: torch.Tensor, eos_token_ids: int | list[int] | None) -> list[int]:
    """Per sequence, the tokens generate() produced up to and including the first EOS.

    `new_tokens` `[B, n]`: the generated part of generate()'s output (after the prompt for a decoder-only
    model, after the decoder start token for an encoder-decoder).
    """
    if eos_token_ids is None:
        eos: list[int] = []
    else:
        eos = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids)
    lengths = []
    for row in new_tokens.tolist():
        stop = next((i for i, token in enumerate(row) if token in eos), None)
        lengths.append(len(row) if stop is None else stop + 1)
    return lengths


def steps_eam(steps: list[SequenceStep], num_layers: int, num_experts: int) -> np.ndarray:
    """The EAM `[L, E]` of one sequence's steps."""
    eam = empty_eam(num_layers, num_experts)
    for step in steps:
        for layer, (ids, _) in step.items():
            add_tokens(eam, layer, ids)
    return eam


def _parameter_names(module: torch.nn.Module) -> list[str]:
    """Names of the positional parameters of `module.forward`, to read hook args by name."""
    params = inspect.signature(module.forward).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
