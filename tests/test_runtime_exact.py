"""The offloaded model computes exactly what the unmodified HF model computes: `torch.equal` logits and
identical greedy tokens, for every family routed with its real top-k, in bf16 and fp32, at the smallest
cache, 50% and 100%; and under every prefetch x eviction pair on two families (the full cross product is
`moeinf bench exact`)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from moeinf import MoE, OffloadConfig
from moeinf.bench.exact import CACHES, DTYPES, Case, batch_inputs, compare, forward_logits, greedy, prepare
from moeinf.config import EVICTION_POLICIES, PREFETCH_POLICIES, ConfigError
from moeinf.hf.tiny import REAL_TOP_K
from moeinf.kernels.moe import Dispatch, ExpertOutputs
from moeinf.runtime.offloader import Offloader

NEW_TOKENS = 64
_CASES: dict[tuple[str, str], Case] = {}


@pytest.fixture(scope="session")
def case(tmp_path_factory: pytest.TempPathFactory):
    """Factory: case(name, dtype) -> one packed store and HF reference per (model, dtype), built once."""

    def make(name: str, dtype: str) -> Case:
        if (name, dtype) not in _CASES:
            root = tmp_path_factory.mktemp(f"exact-{name}-{dtype}")
            _CASES[name, dtype] = prepare(name, dtype, root, NEW_TOKENS)
        return _CASES[name, dtype]

    return make


def assert_exact(row: dict) -> None:
    assert row["tokens_equal"], row
    assert row["logits_equal"], row  # torch.equal, not allclose


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(REAL_TOP_K))
def test_every_family_dtype_and_cache_is_exact(name: str, dtype: str, cache: str, case) -> None:
    defaults = OffloadConfig()
    row = compare(case(name, dtype), cache, defaults.prefetch, defaults.eviction, NEW_TOKENS)
    assert_exact(row)
    if cache == "min":
        assert row["misses"] > 0  # the smallest cache really did fetch on demand
    # shared experts computed while their block waited for a read stood in for the block's own call each time
    assert row["early_shared_served"] == row["early_shared_computed"]
    if cache == "min" and name == "deepseek_v3-top8":
        assert row["early_shared_served"] > 0
    if name == "qwen2_moe-top4":
        assert row["early_shared_computed"] == 0  # its block runs the shared expert before the routed ones


@pytest.mark.parametrize(("prefetch", "eviction"),
                         list(itertools.product(PREFETCH_POLICIES, EVICTION_POLICIES)))
@pytest.mark.parametrize("name", ["qwen3_moe-top8", "deepseek_v3-top8"])
def test_every_policy_pair_is_exact(name: str, prefetch: str, eviction: str, case) -> None:
    assert_exact(compare(case(name, "bfloat16"), "min", prefetch, eviction, NEW_TOKENS))


def test_experts_combine_in_any_order() -> None:
    """The combine does not depend on the order experts are computed in (they land from the cache in
    any order), and equals HF's default experts forward bit for bit in bf16 at top-8."""
    from transformers import AutoModelForCausalLM

    from moeinf.hf.integrate import kernel_for
    from moeinf.hf.tiny import tiny_config
    from moeinf.spec import spec_for

    config = tiny_config("qwen3_moe", num_experts=32, num_experts_per_tok=8)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    experts = model.model.layers[0].mlp.experts
    assert model.config._experts_implementation == "grouped_mm"  # transformers' default: the reference
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0.0, 0.05)
    kernel = kernel_for(experts, spec_for("qwen3_moe"))
    hidden = torch.randn(37, 64, dtype=torch.bfloat16)
    index = torch.stack([torch.randperm(32)[:8] for _ in range(37)])
    weights = torch.softmax(torch.randn(37, 8), dim=-1).to(torch.bfloat16)
    with torch.no_grad():
        want = experts(hidden, index, weights)
        dispatch = Dispatch(index, 32)
        results = []
        for order in (sorted(dispatch.groups), sorted(dispatch.groups, reverse=True)):
            outputs = ExpertOutputs(hidden, weights, dispatch)
            for e in order:
                tensors = {"gate_up_proj": experts.gate_up_proj[e], "down_proj": experts.down_proj[e]}
                outputs.compute(e, kernel, tensors)
            results.append(outputs.result())
    assert torch.equal(results[0], want) and torch.equal(results[1], want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_experts_computed_in_waves_equal_hf(dtype: torch.dtype) -> None:
    """Experts computed several at a time (`compute_many`: one bmm over stacked weights in bf16/fp16, one
    by one in fp32) give HF's default experts forward bit for bit, in one wave or in several."""
    from transformers import AutoModelForCausalLM

    from moeinf.hf.integrate import kernel_for
    from moeinf.hf.tiny import tiny_config
    from moeinf.kernels.moe import BATCHED_EXACT_DTYPES
    from moeinf.spec import spec_for

    config = tiny_config("qwen3_moe", num_experts=32, num_experts_per_tok=8)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0.0, 0.05)
    kernel = kernel_for(experts, spec_for("qwen3_moe"))
    hidden = torch.randn(37, 64, dtype=dtype)
    index = torch.stack([torch.randperm(32)[:8] for _ in range(37)])
    weights = torch.softmax(torch.randn(37, 8), dim=-1).to(dtype)
    with torch.no_grad():
        want = experts(hidden, index, weights)
        dispatch = Dispatch(index, 32)
        order = sorted(dispatch.groups, reverse=True)
        tensors = [{"gate_up_proj": experts.gate_up_proj[e], "down_proj": experts.down_proj[e]}
                   for e in order]
        batched = kernel.many(hidden[:4].expand(2, 4, 64), tensors[:2])
        assert (batched is not None) == (dtype in BATCHED_EXACT_DTYPES)
        for waves, stack in itertools.product(([len(order)], [5, len(order) - 5], [1] * len(order)),
                                              (True, False)):
            outputs, start = ExpertOutputs(hidden, weights, dispatch), 0
            for size in waves:
                outputs.compute_many(order[start:start + size], kernel, tensors[start:start + size],
                                     stack=stack)
                start += size
            assert torch.equal(outputs.result(), want), (waves, stack)


def test_big_experts_are_not_stacked(case) -> None:
    """Stacking copies the weights, so it is bounded by `stack_expert_max_bytes` (0: never); the tokens
    stay HF's either way."""
    exact = case("qwen3_moe-top8", "bfloat16")
    with pytest.raises(ConfigError, match="stack_expert_max_bytes"):
        OffloadConfig(stack_expert_max_bytes=-1)

    def wave(nbytes: int) -> list:
        return [{"w": torch.empty(nbytes, dtype=torch.uint8)} for _ in range(2)]

    for limit in (0, 1000):
        config = OffloadConfig(offload_dir=str(exact.store_dir), device_cache="100%",
                               stack_expert_max_bytes=limit)
        with MoE(exact.model_dir, config) as moe:
            offloader = moe._live().offloader
            assert offloader._stackable(wave(1000)) == (limit == 1000)
            assert not offloader._stackable(wave(1001)) and not offloader._stackable(wave(1)[:1])
            assert torch.equal(greedy(moe.generate, batch_inputs(False), NEW_TOKENS), exact.tokens)


def test_online_eamc_learns_from_scratch_and_grows(case, tmp_path: Path) -> None:
    """Without an EAMC the first finished batch seeds the runtime's EAMC; later ones grow it."""
    exact = case("qwen3_moe-top8", "float32")
    config = OffloadConfig(offload_dir=str(exact.store_dir), device_cache="50%", prefetch="activation-aware",
                           eamc_capacity=5)
    inputs = batch_inputs(False)
    with MoE(exact.model_dir, config) as moe:
        assert torch.equal(greedy(moe.generate, inputs, NEW_TOKENS), exact.tokens)
        assert moe.stats()["prefetches"] == 0  # nothing to predict from yet
        runtime = moe._live()
        assert runtime.offloader.predictor.current.capacity == 2  # seeded by the two sequences
        for seed, grown in ((1, 4), (2, 5), (3, 5)):
            moe.generate(**batch_inputs(False, seed=seed), max_new_tokens=4, do_sample=False)
            assert runtime.offloader.predictor.current.capacity == grown  # up to eamc_capacity
        assert moe.stats()["prefetches"] > 0
        assert torch.equal(forward_logits(moe, inputs, False), exact.logits)


class StepLogits:
    """A logits processor that keeps each decode step's scores (and changes nothing)."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.steps.append(scores.clone())
        return scores


@pytest.mark.parametrize("cache", ["min", 0.5, 1.0])
@pytest.mark.parametrize("name", sorted(REAL_TOP_K))
def test_one_prompt_decodes_exactly_through_the_one_token_path(name: str, cache, case, monkeypatch) -> None:
    """A single prompt decodes one row per step, which groups its token's experts in Python and keeps
    their outputs in slot order (`Dispatch.slot_of`), or with every expert resident hands them to the kernel
    ungrouped (`GatedKernel.rows_into`): every step's logits equal HF's bit for bit, in bf16, with each
    family's real top-k, at the smallest cache, at half the experts (where layers whose experts are all
    resident plan on the planner thread beside their compute) and with every expert resident."""
    from transformers import LogitsProcessorList

    from moeinf.bench.exact import cache_size

    exact = case(name, "bfloat16")
    prompt = {key: value[:1] for key, value in exact.inputs.items()}
    one_token: list[bool] = []
    original = Dispatch._one_token

    def counted(self, *args) -> bool:
        one_token.append(original(self, *args))
        return one_token[-1]

    monkeypatch.setattr(Dispatch, "_one_token", counted)
    resident_rows: list[int] = []
    resident_row = Offloader._resident_row

    def resident(self, layer, *args):
        out = resident_row(self, layer, *args)
        if out is not None:
            resident_rows.append(layer)
        return out

    monkeypatch.setattr(Offloader, "_resident_row", resident)

    def decode(generate) -> tuple[torch.Tensor, list[torch.Tensor]]:
        recorder = StepLogits()
        processors = LogitsProcessorList([recorder])
        tokens = greedy(lambda **kwargs: generate(**kwargs, logits_processor=processors), prompt, 16)
        return tokens, recorder.steps

    want_tokens, want = decode(exact.reference.generate)
    config = OffloadConfig(offload_dir=str(exact.store_dir), device_cache=cache_size(exact, cache))
    one_token.clear()
    with MoE(exact.model_dir, config) as moe:
        got_tokens, got = decode(moe.generate)
        stats, top_k = moe.stats(), moe.store.index.top_k
    # the decoded rows took the one-token path; with every expert resident and nothing to plan they skip the
    # grouping, claims and waves altogether (`_resident_row`), counted as the hits they are; the smallest
    # cache plans at every layer
    assert any(one_token) or cache == 1.0
    assert bool(resident_rows) == (cache == 1.0)
    assert stats["hits"] >= top_k * len(resident_rows)
    if cache == 0.5:
        assert stats["plans_beside_compute"] > 0 or name.startswith("switch")
    assert torch.equal(got_tokens, want_tokens)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
