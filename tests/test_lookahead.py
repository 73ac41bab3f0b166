"""Look-ahead predictors: the routers run on recorded router inputs, the learned maps, their file, the pace,
and exact tokens with the look-ahead prefetch choices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeinf import MoE, OffloadConfig
from moeinf.config import ConfigError
from moeinf.hf.integrate import experts_sites
from moeinf.hf.spec import spec_for
from moeinf.runtime import lookahead as runtime_lookahead
from moeinf.runtime.lookahead import Lookahead, Pace, RouterPredictor, find_routers
from moeinf.trace import lookahead_fit
from moeinf.trace.lookahead_fit import HiddenRecords
from moeinf.trace.router import RouterTracer

ROUTED_FAMILIES = ("deepseek_v3", "qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe")


def reference(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def assert_exact(moe: MoE, model_dir, seq2seq: bool) -> None:
    """Greedy tokens and logits equal the unmodified model's (H1's test_runtime_exact covers every family,
    dtype and policy pair; this checks the look-ahead paths these tests set up)."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    ref = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(model_dir).eval()
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(moe.generate(ids, max_new_tokens=12, do_sample=False),
                           ref.generate(ids, max_new_tokens=12, do_sample=False))
        kwargs = {"decoder_input_ids": torch.zeros((2, 3), dtype=torch.long)} if seq2seq else {}
        assert torch.equal(moe(ids, **kwargs).logits, ref(ids, **kwargs).logits)


def routers_of(model) -> list[torch.nn.Module] | None:
    spec = spec_for(model.config.model_type)
    return find_routers(model, spec, [site.name for site in experts_sites(model, spec)])


@pytest.mark.parametrize("family", ROUTED_FAMILIES)
def test_recorded_router_inputs_reproduce_the_routing(family: str, tiny_model_dir) -> None:
    """Each layer's router run on that layer's recorded input picks exactly the experts the model routed:
    the recorded state is the router input and the router math is the model's own."""
    model = reference(tiny_model_dir(family))
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with RouterTracer(model, hidden=True) as tracer, torch.no_grad():
        model.generate(ids, max_new_tokens=3, do_sample=False)
    hidden, routed = tracer.sequence_hidden(1)  # [N, L, H], [N, L, k]
    assert hidden.shape[:2] == routed.shape[:2] == (9 + 2, tracer.num_layers)
    routers = routers_of(model)
    assert routers is not None and len(routers) == tracer.num_layers
    predictor = RouterPredictor(routers, tracer.num_experts)
    for layer in range(1, tracer.num_layers):
        # depth 1 from layer - 1's input is the router of `layer`; its own input reproduces the routing
        x = torch.from_numpy(hidden[:, layer])
        _, _, index = routers[layer](x.to(routers[layer].weight.dtype))
        assert torch.equal(index.sort(dim=-1).values, torch.from_numpy(routed[:, layer]).sort(dim=-1).values)
        chances = predictor(layer - 1, 1, x)
        assert chances.shape == (len(x), tracer.num_experts)
        assert torch.all(chances.sum(dim=1) == routed.shape[2])
    assert predictor(tracer.num_layers - 1, 1, torch.from_numpy(hidden[:, -1])) is None


def test_switch_has_no_router_that_runs_alone(tiny_model_dir) -> None:
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir("switch_transformers")).eval()
    assert routers_of(model) is None


def synthetic_records(n: int = 600, hidden: int = 8, experts: int = 6, seed: int = 0) -> HiddenRecords:
    """Layer l+1's top-2 experts are a fixed linear function of layer l's input: learnable exactly."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 3, hidden)).astype(np.float32)
    projection = rng.standard_normal((hidden, experts)).astype(np.float32)
    ids = np.zeros((n, 3, 2), dtype=np.int64)
    for layer in range(1, 3):
        ids[:, layer] = np.argsort(-(x[:, layer - 1] @ projection), axis=1)[:, :2]
    ids[:, 0] = rng.integers(0, experts, (n, 2))
    return HiddenRecords(x, ids, np.arange(n) // 10)


def test_learned_maps_fit_save_and_load(tmp_path) -> None:
    records = synthetic_records()
    train, test = records.split(0.25)
    assert set(train.sequence.tolist()).isdisjoint(test.sequence.tolist())
    maps = lookahead_fit.fit(train, 6, depth=2, steps=300)
    assert set(maps.weight) == {(0, 1), (0, 2), (1, 1)}  # no map past the last layer
    quality = lookahead_fit.slot_quality(maps.predict, test, 6, 2, threshold=0.3)
    assert quality[1]["recall"] > 0.85 and quality[1]["precision"] > 0.6  # the depth-1 maps are linear
    path = lookahead_fit.save(maps, lookahead_fit.predictor_path(tmp_path / "m.eamc"), {"fingerprint": "abc"})
    assert path.name == "m.lookahead.safetensors"
    loaded = lookahead_fit.load(path, fingerprint="abc")
    assert loaded.depth == 2 and all(torch.equal(loaded.weight[k], w) for k, w in maps.weight.items())
    with pytest.raises(ValueError, match="fingerprint"):
        lookahead_fit.load(path, fingerprint="other")


def test_lookahead_chances_skip_padding_and_fall_back_to_routers() -> None:
    records = synthetic_records()
    maps = lookahead_fit.fit(records, 6, depth=1, steps=50)
    look = Lookahead(2, 6, maps)
    x = torch.from_numpy(records.hidden[:4, 0])
    # depth 1 from the learned map, depth 2 has neither map nor routers: one row
    assert look.chances(0, x, None).shape == (1, 6)
    assert look.chances(0, x, torch.zeros(4, dtype=torch.bool)) is None
    only_first = look.chances(0, x, torch.tensor([True, False, False, False]))
    np.testing.assert_allclose(only_first[0], maps.predict(0, 1, x[:1])[0].numpy(), rtol=1e-6)


def test_pace_measures_layer_compute_and_bandwidth(monkeypatch) -> None:
    clock = iter([0.0, 0.010, 0.030])
    monkeypatch.setattr(runtime_lookahead.time, "perf_counter", lambda: next(clock))
    pace = Pace(smoothing=0.5)
    assert pace.reads_per_layer(1000) is None
    pace.layer_started(0, stall_s=0.0, bytes_read=0, reading=True)
    pace.layer_started(1, stall_s=0.004, bytes_read=5000, reading=True)  # 10 ms, 4 of them stalled
    assert pace.layer_seconds == pytest.approx(0.006) and pace.bandwidth == pytest.approx(5e5)
    pace.layer_started(0, stall_s=0.004, bytes_read=5000, reading=False)  # a new pass: no layer time
    assert pace.layer_seconds == pytest.approx(0.006) and pace.bandwidth == pytest.approx(5e5)
    assert pace.reads_per_layer(1000) == pytest.approx(3.0)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "switch_transformers"])
@pytest.mark.parametrize("prefetch", ["lookahead", "hybrid"])
def test_lookahead_choices_keep_tokens_exact(family: str, prefetch: str, tiny_model_dir, tmp_path) -> None:
    model_dir = tiny_model_dir(family)
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache=0.3, prefetch=prefetch,
                           lookahead_predictor="routers")
    if family == "switch_transformers" and prefetch == "lookahead":
        with pytest.raises(ConfigError, match="hybrid"):
            MoE(model_dir, config)
        return
    with MoE(model_dir, config) as moe:
        assert_exact(moe, model_dir, family == "switch_transformers")
        if family != "switch_transformers":
            assert moe.stats()["prefetches"] > 0


def test_trace_writes_the_learned_predictor_that_the_runtime_loads(tiny_model_dir, tmp_path, capsys) -> None:
    import json

    from moeinf.cli import main

    model_dir = tiny_model_dir("qwen3_moe")
    prompts = tmp_path / "p.jsonl"
    words = ["one", "two", "three", "four", "five", "six"]
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "task": "t", "prompt": f"Say {i} times {w}."})
                               + "\n" for i, w in enumerate(words)))
    out = tmp_path / "t.eamc"
    assert main(["trace", str(model_dir), "--prompts", str(prompts), "--out", str(out), "--capacity", "3",
                 "--max-new-tokens", "4", "--lookahead-depth", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["lookahead"]["out"] == str(lookahead_fit.predictor_path(out))
    assert set(result["lookahead"]["held_out"]) == {"1", "2"}  # JSON keys: depths 1 and 2 scored
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache=0.3, prefetch="lookahead",
                           eamc=str(out))
    with MoE(model_dir, config) as moe:
        assert moe._runtime.offloader.lookahead.learned is not None
        assert_exact(moe, model_dir, False)
    with pytest.raises(ConfigError, match="lookahead_predictor"):
        MoE(model_dir, config.replace(lookahead_predictor=str(tmp_path / "missing.safetensors")))
