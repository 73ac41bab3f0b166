"""Group-free top-k routers (`fast_dense_modules`): bit-equal to transformers' router, replaced only where
every group is kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeinf import MoE, OffloadConfig
from moeinf.models.deepseek_v3.router import (
    ROUTER_ATTRIBUTES,
    GroupFreeTopkRouter,
    is_group_free_topk_router,
    replace_routers,
)


def hf_router(n_group: int, topk_group: int, norm: bool) -> torch.nn.Module:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
                              topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=generator) * 0.1)
    return router


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_group_free_router_returns_the_routers_tensors_bit_for_bit(norm: bool,
                                                                       dtype: torch.dtype) -> None:
    router = hf_router(1, 1, norm)
    assert is_group_free_topk_router(router)
    fast = GroupFreeTopkRouter(router)
    x = torch.randn(2, 37, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        want, got = router(x), fast(x)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert dict(fast.named_parameters()).keys() == dict(router.named_parameters()).keys()
    assert dict(fast.named_buffers()).keys() == dict(router.named_buffers()).keys()
    # the widened weight it keeps follows writes to the weight
    with torch.no_grad():
        router.weight.mul_(-1)
    with torch.inference_mode():
        want, got = router(x), fast(x)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_routers_that_drop_groups_or_score_otherwise_are_left_alone() -> None:
    class LookAlikeTopkRouter(torch.nn.Module):  # the same attributes, another family's scoring
        def __init__(self, router: torch.nn.Module) -> None:
            super().__init__()
            self.__dict__.update({k: v for k, v in vars(router).items() if not k.startswith("_")})
            self.weight = router.weight
            self.register_buffer("e_score_correction_bias", router.e_score_correction_bias)

    model = torch.nn.ModuleDict({"keeps": hf_router(2, 2, True), "drops": hf_router(4, 2, True),
                                 "other": LookAlikeTopkRouter(hf_router(1, 1, True))})
    assert all(hasattr(model["other"], name) for name in ROUTER_ATTRIBUTES)
    assert replace_routers(model) == ["keeps"]
    assert type(model["keeps"]) is GroupFreeTopkRouter
    assert type(model["drops"]).__name__ == "DeepseekV3TopkRouter"


@pytest.mark.parametrize("fast", [True, False])
def test_an_exact_store_with_fast_routers_stays_hfs(fast: bool, tiny_model_dir, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir("deepseek_v3", dtype="bfloat16", n_group=1, topk_group=1)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        want = ref(ids).logits
    config = OffloadConfig(offload_dir=str(tmp_path / "exact"), device_cache=0.5, fast_dense_modules=fast)
    with MoE(model_dir, config) as moe:
        replaced = [m for m in moe.model.modules() if isinstance(m, GroupFreeTopkRouter)]
        with torch.inference_mode():
            got = moe(ids).logits
    assert len(replaced) == (2 if fast else 0)  # the two MoE layers (first_k_dense_replace=1)
    assert torch.equal(got, want)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_quantised_stores_router_picks_a_decoded_rows_experts_in_the_kernels(norm: bool, dtype: torch.dtype,
                                                                              monkeypatch) -> None:
    """One row: the logits and the experts' weights to float32 rounding (the kernel sums in its own order),
    the same experts (as a set: the kernel lists them largest first); more rows, or an exact store's router,
    keep the torch ops bit for bit."""
    from moeinf import _kernels
    from moeinf.kernels import gemv

    if not gemv.available():
        pytest.skip("the kernels module's row product needs an x86 CPU with AVX2/FMA/F16C")
    calls, products = [], []
    original, product = _kernels.sigmoid_topk, _kernels.dense_row_product
    monkeypatch.setattr(_kernels, "sigmoid_topk", lambda *args: calls.append(args) or original(*args))
    monkeypatch.setattr(_kernels, "dense_row_product", lambda *args: products.append(args) or product(*args))
    router = hf_router(1, 1, norm).to(dtype)
    fast = GroupFreeTopkRouter(router, one_row_kernel=True)
    exact = GroupFreeTopkRouter(router)
    rows = torch.randn(40, 1, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.inference_mode():
        for row in rows:
            (logits, weights, ids), (want_logits, want_weights, want_ids) = fast(row), router(row)
            torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
            assert ids.dtype == want_ids.dtype
            got = dict(zip(ids[0].tolist(), weights[0].tolist(), strict=True))
            want = dict(zip(want_ids[0].tolist(), want_weights[0].tolist(), strict=True))
            assert got.keys() == want.keys()
            assert all(abs(got[e] - want[e]) <= 1e-5 * abs(want[e]) for e in want)
            scores = (logits[0].sigmoid() + router.e_score_correction_bias.float())[ids[0]]
            assert (scores[:-1] >= scores[1:]).all()  # largest first
        assert len(calls) == len(products) == len(rows)
        batch = rows.view(1, 40, 64)
        assert all(torch.equal(a, b) for a, b in zip(fast(batch), router(batch), strict=True))
        assert all(torch.equal(a, b) for a, b in zip(exact(rows[0]), router(rows[0]), strict=True))
    assert len(calls) == len(rows)


def test_a_routers_kernel_arguments_follow_its_weight_and_bias() -> None:
    """The one-row path keeps the kernels' arguments between rows; a weight or bias moved to new storage
    (a `.to`, a loaded state) is what the next row reads, never the old addresses."""
    from moeinf.kernels import gemv

    if not gemv.available():
        pytest.skip("the kernels module's row product needs an x86 CPU with AVX2/FMA/F16C")
    router = hf_router(1, 1, True).to(torch.bfloat16)
    fast = GroupFreeTopkRouter(router, one_row_kernel=True)
    row = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.inference_mode():
        before = fast(row)[0]
        fast.weight.data = torch.randn_like(fast.weight) * 3  # new storage, same parameter
        fast.e_score_correction_bias = torch.randn_like(fast.e_score_correction_bias)
        logits, weights, ids = fast(row)
        want = row.view(1, 64).float() @ fast.weight.float().T
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
        assert not torch.equal(logits, before)
        scores = logits[0].sigmoid() + fast.e_score_correction_bias.float()
        assert set(ids[0].tolist()) == set(scores.topk(ids.shape[1]).indices.tolist())
