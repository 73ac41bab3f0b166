"""Shared experts computed while the routed experts of their MoE block wait for a read.

A DeepSeek, Qwen2-MoE, GLM-4.5 or Llama-4 MoE block runs its shared experts on the block's input after
(or beside) its routed experts: HF's `DeepseekV2MoE.forward` is `experts(x, ...)`, then
`shared_experts(residuals)`. While a routed expert is read from the drive the compute thread is idle, and
the shared experts, which need nothing but the block's input, are as large as two routed experts at
DeepSeek-V2-Lite's geometry. `EarlyShared` replaces a shared-experts module's `forward` per instance: the
block's `OffloadedExperts` arms it at every call, and the layer's wait (`ExpertCache.acquire_waves`) runs
it once, as the last thing before it blocks; the block's own call then gets that output if it passes an
input equal to a copy of what the experts got (compared element by element: inference tensors keep no
version counter, and the copy is one row per token). Same module, same input, same thread count: the
same bits as the call it stands for (the tests compare logits with HF's).

A shared module whose `forward` takes more than the block's input (Inkling's takes the router's gammas)
is left alone. Elsewhere it stays out of the way where it cannot help: with autograd on, where the
block's input is not what the routed experts got, and where the block does not call the module's
`forward` after its experts: a call before them (Qwen2-MoE runs its shared expert first) turns the early
product off for that module for good, as does an output made early and never taken (a flat decode that
binds the products itself), one product wasted.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class EarlyShared:
    """The `forward` of one shared-experts module: its own forward, or the output computed early for the
    same input (module docstring). `computed` / `served` count the early products made and used."""

    def __init__(self, module: nn.Module) -> None:
        self.forward: Callable[..., Any] = module.forward  # the module's own (bound) forward
        self.enabled = True
        self.computed = 0
        self.served = 0
        self._armed = False
        self._memo: tuple[torch.Tensor, torch.Tensor] | None = None  # (a copy of the input, the output)

    def arm(self) -> None:
        """The block's routed experts are called: from now until the block's shared call, `compute` may run.
        An early output still unused from the previous call means the block does not call us after its
        experts: stop computing early."""
        if self._memo is not None:
            self.enabled = False
            self._memo = None
        self._armed = True

    def compute(self, hidden_states: torch.Tensor) -> None:
        """Run the shared experts on the routed experts' input `hidden_states` [T, H] now, once per arming."""
        if not (self._armed and self.enabled) or torch.is_grad_enabled():
            return
        self._armed = False
        self._memo = (hidden_states.clone(), self.forward(hidden_states))
        self.computed += 1

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        memo, self._memo = self._memo, None
        if memo is None and not self._armed:
            self.enabled = False  # called before the block's experts (Qwen2-MoE's order): nothing to do early
        self._armed = False
        if memo is not None:
            given, out = memo
            if not args and not kwargs and hidden_states.numel() == given.numel() \
                    and hidden_states.shape[-1] == given.shape[-1] and hidden_states.dtype == given.dtype \
                    and hidden_states.device == given.device \
                    and torch.equal(hidden_states.reshape(given.shape), given):
                self.served += 1
                return out.view(*hidden_states.shape[:-1], out.shape[-1])
            self.enabled = False  # the block passed something else: the early product cannot stand in
        return self.forward(hidden_states, *args, **kwargs)


def install(model: nn.Module, shared_pattern: str | None) -> list[str]:
    """Give each shared-experts module of `model` (names matching `shared_pattern`, `ArchSpec.
    shared_experts_module`) whose block also holds an `OffloadedExperts` an `EarlyShared` forward, and that
    experts module its `early_shared`; the shared modules' names."""
    if shared_pattern is None:
        return []
    # an `OffloadedExperts` declares `early_shared` (duck-typed: that module imports this one)
    blocks = {name.rpartition(".")[0]: module for name, module in model.named_modules()
              if "early_shared" in vars(module)}
    done = []
    for name, module in model.named_modules():
        block = blocks.get(name.rpartition(".")[0])
        if block is None or not re.search(shared_pattern, name) or not _takes_one_input(module.forward):
            continue
        early = EarlyShared(module)
        module.forward = early
        block.early_shared = early
        done.append(name)
    return done


def _takes_one_input(forward: Callable[..., Any]) -> bool:
    """Whether `forward` takes the block's input and nothing else (Inkling's also takes the router's gammas:
    an early product without them would not be the block's)."""
    if isinstance(forward, EarlyShared):
        return False
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                     inspect.Parameter.POSITIONAL_OR_KEYWORD)


def counts(model: nn.Module) -> tuple[int, int]:
    """(early products computed, early products served) over the shared-experts modules of `model`."""
    early = [module.__dict__["forward"] for module in model.modules()
             if isinstance(module.__dict__.get("forward"), EarlyShared)]
    return sum(e.computed for e in early), sum(e.served for e in early)
