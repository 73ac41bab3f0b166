"""The scale benchmark's parts on a tiny synthesised DeepSeek-V2 (same code as the full-size run): replaying a
raw routing trace routes every MoE layer as the trace did, in HF and in moeinf alike; the cgroup runner
caps a pack and reports its peak; `moeinf bench scale` writes its rows."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from moeinf.bench.replay_routing import ReplayError, RoutingCursor
from moeinf.bench.trace_routing import TraceMismatch, install_trace_replay, moe_blocks, trace_routings
from moeinf.trace.rawtrace import RawTrace, write_raw
from moeinf.zoo.synth import synth

TINY = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 16, "vocab_size": 8192}
LAYERS, EXPERTS, TOP_K = 2, 16, 6
PROMPT, NEW = 7, 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth("deepseek-v2-lite", tmp_path_factory.mktemp("synth") / "dsv2", overrides=TINY,
                 shard_bytes=200_000)


def make_trace(path: Path, requests: int = 3, prefill: int = PROMPT, decode: int = NEW + 2) -> Path:
    """Random routing: per request a prefill step of `prefill` tokens then `decode` one-token steps."""
    rng = np.random.default_rng(0)
    traces = []
    for r in range(requests):
        steps = []
        for tokens in [prefill] + [1] * decode:
            step = {}
            for layer in range(LAYERS):
                ids = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(tokens)])
                step[layer] = (ids, np.full((tokens, TOP_K), 1 / TOP_K, dtype=np.float32))
            steps.append(step)
        traces.append(RawTrace(f"req-{r}", "chat", LAYERS, EXPERTS, TOP_K, steps))
    return write_raw(path, traces)


class IndexRecorder:
    """Forward pre-hooks on the experts modules of an HF model: the expert ids each call got."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[list[torch.Tensor]] = [[] for _ in moe_blocks(model)]
        for layer, block in enumerate(moe_blocks(model)):
            block.experts.register_forward_pre_hook(self._hook(layer))

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            self.calls[layer].append(args[1].clone())
        return hook


def test_replayed_trace_routes_hf_and_moeinf_alike(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from moeinf import MoE, OffloadConfig

    trace = make_trace(tmp_path / "trace.jsonl.gz")
    routings = trace_routings(trace, num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K, count=2,
                              positions=NEW, prompt_ids=[5, 9, 11])
    assert [r.prompt_length for r in routings] == [PROMPT, PROMPT]
    ids = routings[0].prompt_ids(TINY["vocab_size"])
    assert ids[0, :4].tolist() == [5, 9, 11, 5]

    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        own = hf(ids).logits
    cursor = RoutingCursor(routings)
    install_trace_replay(hf, cursor)
    recorder = IndexRecorder(hf)
    expected, logits = [], []
    with torch.inference_mode():
        for i, routing in enumerate(routings):
            cursor.start(i)
            expected.append(hf.generate(routing.prompt_ids(TINY["vocab_size"]), max_new_tokens=NEW,
                                        do_sample=False))
            cursor.start(i)
            logits.append(hf(expected[i]).logits)
    # Request 0, layer 1: the prefill's positions, then one per decode step, exactly the trace's ids.
    seen = torch.cat(recorder.calls[1][: NEW])
    assert torch.equal(seen, routings[0].index[: PROMPT + NEW - 1, 1])
    assert not torch.equal(logits[0][:, :PROMPT], own)  # the trace, not the random router, chose

    with MoE(model_dir, OffloadConfig(device_cache=0.4, offload_dir=str(tmp_path / "store"))) as moe:
        cursor = RoutingCursor(routings)
        install_trace_replay(moe.model, cursor)
        for i, routing in enumerate(routings):
            cursor.start(i)
            got = moe.generate(routing.prompt_ids(TINY["vocab_size"]), max_new_tokens=NEW, do_sample=False)
            assert torch.equal(got, expected[i])
            cursor.start(i)
            with torch.inference_mode():
                assert torch.equal(moe(got).logits, logits[i])


def test_trace_of_another_geometry_or_too_short_is_refused(tmp_path: Path) -> None:
    trace = make_trace(tmp_path / "trace.jsonl.gz")
    with pytest.raises(TraceMismatch, match="the model has 3 x 16"):
        trace_routings(trace, num_layers=3, num_experts=EXPERTS, top_k=TOP_K, count=1, positions=1,
                       prompt_ids=[1])
    with pytest.raises(ReplayError, match="3 requests"):
        trace_routings(trace, num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K, count=4, positions=1,
                       prompt_ids=[1])
    with pytest.raises(ReplayError, match="0 requests"):
        trace_routings(trace, num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K, count=1, positions=50,
                       prompt_ids=[1])
