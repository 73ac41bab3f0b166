"""Shared experts computed while their block waits for a read (`moeinf.runtime.shared`): the early output
stands in for the block's own call only on an equal input, and a block that calls them in another order
turns it off; end to end the logits stay HF's (tests/test_runtime_exact.py)."""

from __future__ import annotations

import torch
from torch import nn

from moeinf.runtime.shared import EarlyShared


class Counted(nn.Module):
    """A shared-experts stand-in that counts the products it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 6, bias=False, dtype=torch.bfloat16)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.proj(x)


def early_module() -> tuple[Counted, EarlyShared]:
    torch.manual_seed(0)
    module = Counted()
    early = EarlyShared(module)
    module.forward = early
    return module, early


def test_the_early_output_stands_in_for_the_blocks_call_on_the_same_input() -> None:
    module, early = early_module()
    residuals = torch.randn(1, 3, 8, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = module.proj(residuals)
        for _ in range(3):  # DeepSeek: the experts (armed, computed while they wait), then shared(residuals)
            early.arm()
            early.compute(residuals.view(-1, 8))
            out = module(residuals)
            assert torch.equal(out, expected) and out.shape == (1, 3, 6)
    assert module.calls == 3 and early.computed == early.served == 3 and early.enabled


def test_a_layer_that_waits_for_nothing_computes_in_the_blocks_call() -> None:
    module, early = early_module()
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with torch.inference_mode():
        early.arm()  # no compute: every expert was resident
        assert torch.equal(module(x), module.proj(x))
    assert module.calls == 1 and early.computed == 0 and early.enabled


def test_another_input_is_computed_again_and_turns_the_early_product_off() -> None:
    module, early = early_module()
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    other = x.clone()
    other[1, 3] += 1
    with torch.inference_mode():
        early.arm()
        early.compute(x)
        assert torch.equal(module(other), module.proj(other))
        assert early.served == 0 and not early.enabled
        early.arm()
        early.compute(x)  # off: nothing early any more
    assert early.computed == 1


def test_an_input_changed_in_place_after_the_early_product_is_computed_again() -> None:
    module, early = early_module()
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with torch.inference_mode():
        early.arm()
        early.compute(x)
        x[0, 0] = 7.0  # inference tensors keep no version counter: the contents are compared
        assert torch.equal(module(x), module.proj(x))
    assert early.served == 0


def test_a_block_that_runs_its_shared_experts_first_never_computes_early() -> None:
    module, early = early_module()
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with torch.inference_mode():
        for _ in range(2):  # Qwen2-MoE's order: shared(x), then the experts
            module(x)
            early.arm()
            early.compute(x)
    assert early.computed == 0 and not early.enabled and module.calls == 2


def test_an_early_output_never_taken_turns_it_off() -> None:
    module, early = early_module()
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with torch.inference_mode():
        early.arm()
        early.compute(x)  # a flat decode that binds the shared products itself never calls the forward
        early.arm()
        early.compute(x)
    assert early.computed == 1 and not early.enabled


def test_autograd_computes_in_the_blocks_call() -> None:
    module, early = early_module()
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    early.arm()
    early.compute(x)  # grad mode: the block's own call builds the graph
    assert early.computed == 0
    assert module(x).requires_grad


class Gated(nn.Module):
    """Shared experts whose forward also takes the router's output (Inkling's gammas)."""

    def forward(self, x: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
        return x * gammas


def test_install_wraps_the_shared_experts_of_offloaded_blocks_that_take_the_input_alone() -> None:
    from moeinf.runtime.experts import OffloadedExperts
    from moeinf.runtime.shared import install

    blocks = nn.ModuleList()
    for shared in (Counted(), Gated(), Counted()):
        block = nn.Module()
        block.experts = OffloadedExperts(0, 2, None, None)  # type: ignore[arg-type]
        block.shared_experts = shared
        blocks.append(block)
    dense = nn.Module()
    dense.shared_experts = Counted()  # no offloaded experts beside it: not a MoE block of this runtime
    model = nn.Module()
    model.layers, model.dense = blocks, dense
    assert install(model, r"\.shared_experts$") == ["layers.0.shared_experts", "layers.2.shared_experts"]
    assert isinstance(blocks[0].experts.early_shared, EarlyShared)
    assert blocks[1].experts.early_shared is None and blocks[2].experts.early_shared is not None
    assert install(model, r"\.shared_experts$") == []  # installed once
    assert install(model, None) == []
