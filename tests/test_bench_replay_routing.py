"""Replaying the zoo model's routing through a larger Qwen3-MoE (moeinf.bench.replay_routing)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeinf import MoE, OffloadConfig, zoo
from moeinf.bench.replay_routing import (
    ExpertMapping,
    ReplayError,
    Routing,
    RoutingCursor,
    build_replay_eamc,
    install_replay,
    map_recordings,
    record_routing,
)
from moeinf.hf.tiny import save_tiny

PROMPTS = ["What is the capital of France?", "Add 17 and 25, then explain each step of the sum in detail."]
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny zoo variant: 2 MoE layers, top-2 of 8 experts."""
    return zoo.get_model("tiny", cache_dir=tmp_path_factory.mktemp("zoo-cache"), threads=1, progress=False)


@pytest.fixture(scope="module")
def routings(zoo_dir: Path) -> list[Routing]:
    """The tiny zoo's routing replayed as top-4 of 16: zoo_top = 2, the zoo's own top_k."""
    recordings = record_routing(zoo_dir, PROMPTS, new_tokens=NEW_TOKENS, max_prompt_tokens=20, seed=0)
    return map_recordings(recordings, ExpertMapping(8, 16, 4))


@pytest.fixture(scope="module")
def big_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("qwen3_moe", tmp_path_factory.mktemp("big"), num_experts=16, num_experts_per_tok=4,
                     num_hidden_layers=2)


def test_mapping_takes_the_zoo_top_by_selection_and_weights_by_score() -> None:
    mapping = ExpertMapping(zoo_experts=4, big_experts=8, big_top_k=4)
    assert (mapping.group, mapping.zoo_top) == (2, 2)
    selection = torch.tensor([[0.1, 0.9, 0.5, 0.2]])  # the bias makes expert 3 lose to 1 and 2
    scores = torch.tensor([[0.3, 0.6, 0.2, 0.9]])
    index, weights = mapping.map(selection, scores)
    assert index.tolist() == [[2, 3, 4, 5]] and index.dtype == torch.int64
    torch.testing.assert_close(weights, torch.tensor([[0.375, 0.375, 0.125, 0.125]]))
    assert ExpertMapping(64, 128, 8).describe("full") == "zoo-full replayed (top-4 of 64 -> 8 of 128)"


@pytest.mark.parametrize("shape", [(64, 96, 8), (64, 128, 7), (8, 16, 18)])
def test_mapping_refuses_shapes_it_cannot_group(shape: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match="cannot"):
        ExpertMapping(*shape)


def test_cursor_serves_prefill_then_decode_rows_and_refuses_overrun() -> None:
    index = torch.arange(5 * 2 * 2).view(5, 2, 2)  # [T=5, L=2, k=2]
    routing = Routing(torch.arange(5), 3, index, index.float())
    cursor = RoutingCursor([routing])
    with pytest.raises(ReplayError, match="start"):
        cursor.take(0, 1)
    cursor.start(0)
    for layer in (0, 1):
        assert torch.equal(cursor.take(layer, 3)[0], index[0:3, layer])  # prefill
    for position in (3, 4):  # decode steps
        for layer in (0, 1):
            got, weights = cursor.take(layer, 1)
            assert torch.equal(got, index[position:position + 1, layer])
            assert torch.equal(weights, index[position:position + 1, layer].float())
    with pytest.raises(ReplayError, match="5 were recorded"):
        cursor.take(0, 1)
    cursor.start(0)
    assert torch.equal(cursor.take(1, 1)[0], index[0:1, 1])
    with pytest.raises(ReplayError, match="not recorded"):
        cursor.start(1)


def test_recording_gives_top_k_distinct_experts_per_position(routings: list[Routing]) -> None:
    for routing in routings:
        tokens = routing.prompt_length + NEW_TOKENS
        assert routing.index.shape == (tokens, 2, 4) and routing.weights.shape == (tokens, 2, 4)
        assert routing.prompt_length <= 20
        assert all(len(set(row.tolist())) == 4 for row in routing.index.reshape(-1, 4))
        pairs = routing.index.view(tokens, 2, 2, 2)  # a zoo expert's group of 2 big experts stays together
        assert (pairs[..., 0] % 2 == 0).all() and (pairs[..., 1] == pairs[..., 0] + 1).all()
        torch.testing.assert_close(routing.weights.sum(-1), torch.ones(tokens, 2))


def test_replayed_groups_are_the_experts_the_zoo_routes_to(zoo_dir: Path, routings: list[Routing]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(zoo_dir, dtype=torch.float32).eval()
    calls, handles = experts_inputs(model)
    for routing in routings:
        with torch.no_grad():
            model(routing.token_ids.unsqueeze(0))
        for layer, seen in enumerate(calls):
            zoo_experts = routing.index[:, layer, ::2] // 2  # [T, 2]: one per group
            assert torch.equal(zoo_experts.sort(-1).values, seen.pop().sort(-1).values)
    for handle in handles:
        handle.remove()


def experts_inputs(model: torch.nn.Module) -> tuple[list[list[torch.Tensor]], list]:
    """Per MoE layer, the top_k_index of every call of its experts module (pre-hooks; remove the handles)."""
    calls: list[list[torch.Tensor]] = []
    handles = []
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):  # Qwen3-MoE and DeepSeek-V3 alike
            seen: list[torch.Tensor] = []
            calls.append(seen)
            handles.append(module.register_forward_pre_hook(lambda _m, args, seen=seen: seen.append(args[1])))
    return calls, handles


def test_hf_model_routes_exactly_the_recorded_experts(routings: list[Routing], big_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(big_dir).eval()
    cursor = RoutingCursor(routings)
    install_replay(model, cursor)
    calls, handles = experts_inputs(model)
    for prompt, routing in enumerate(routings):
        for seen in calls:
            seen.clear()
        cursor.start(prompt)
        with torch.inference_mode():
            model.generate(routing.prompt_ids(model.config.vocab_size), max_new_tokens=NEW_TOKENS,
                           min_new_tokens=NEW_TOKENS, do_sample=False)
        fed = routing.prompt_length + NEW_TOKENS - 1  # the last generated token is never fed back
        for layer, seen in enumerate(calls):
            assert len(seen) == NEW_TOKENS
            assert torch.equal(torch.cat(seen), routing.index[:fed, layer])
    for handle in handles:
        handle.remove()


def test_install_refuses_a_model_with_other_layer_count(routings: list[Routing], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        save_tiny("qwen3_moe", tmp_path, num_experts=16, num_experts_per_tok=4, num_hidden_layers=3))
    with pytest.raises(ReplayError, match="3 MoE layers"):
        install_replay(model, RoutingCursor(routings))


def test_offloaded_model_with_replay_matches_hf_with_replay(routings: list[Routing], big_dir: Path,
                                                           tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    eamc = build_replay_eamc(big_dir, routings, tmp_path / "replay.eamc", description="test")
    reference = AutoModelForCausalLM.from_pretrained(big_dir).eval()
    ref_cursor, cursor = RoutingCursor(routings), RoutingCursor(routings)
    install_replay(reference, ref_cursor)
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache=0.3, eamc=str(eamc))
    with MoE(big_dir, config) as moe:
        install_replay(moe.model, cursor)
        for prompt, routing in enumerate(routings):
            ids = (routing.token_ids % reference.config.vocab_size).unsqueeze(0)  # [1, T]
            cursor.start(prompt)
            ref_cursor.start(prompt)
            with torch.inference_mode():
                want = reference(ids).logits
            torch.testing.assert_close(moe(ids).logits, want)
            cursor.start(prompt)
            ref_cursor.start(prompt)
            kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
            got = moe.generate(routing.prompt_ids(reference.config.vocab_size), **kwargs)
            with torch.inference_mode():
                assert torch.equal(got, reference.generate(routing.prompt_ids(reference.config.vocab_size),
                                                           **kwargs))
        assert moe.stats()["misses"] > 0


def test_accelerate_baseline_replays_the_routing(routings: list[Routing], big_dir: Path) -> None:
    from moeinf.bench.accelerate_baseline import accelerate_token_latency

    result = accelerate_token_latency(big_dir, PROMPTS, NEW_TOKENS, cache=0.5, warmup=1, routings=routings)
    assert result["routing"] == "replayed" and len(result["latencies"]) == NEW_TOKENS - 1
