"""Look-ahead predictors: the routers run on recorded router inputs, the learned maps, their file, the pace,
and exact tokens with the look-ahead prefetch choices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeinf import MoE, OffloadConfig
from moeinf.config import ConfigError
from moeinf.hf.integrate import experts_sites
from moeinf.runtime import lookahead as runtime_lookahead
from moeinf.runtime.lookahead import FirstLayerGuess, Lookahead, Pace, RouterPredictor, find_routers
from moeinf.runtime.offloader import GUESS_PRIORITY, GUESS_STEP
from moeinf.spec import spec_for
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
    maps = lookahead_fit.fit(train, 6, depth=2, steps=300)  # wrap=False, the default
    assert set(maps.first) == set(maps.second) == {0, 1}  # no map from the last layer
    assert not maps.wraps
    x, routed = torch.from_numpy(test.hidden[:, 0]), torch.from_numpy(test.ids[:, 0])
    assert maps.chances(0, x, routed).shape == (2, len(x), 6)  # depths 1 and 2 at once
    assert maps.chances(1, x, routed).shape == (1, len(x), 6)  # layer 2 is the last
    assert maps.predict(1, 2, x, routed) is None and maps.chances(2, x, routed) is None
    quality = lookahead_fit.slot_quality(maps.predict, test, 6, 2, threshold=0.3)
    assert quality[1]["recall"] > 0.85 and quality[1]["precision"] > 0.6  # depth 1 is learnable
    path = lookahead_fit.save(maps, lookahead_fit.predictor_path(tmp_path / "m.eamc"), {"fingerprint": "abc"})
    assert path.name == "m.lookahead.safetensors"
    loaded = lookahead_fit.load(path, fingerprint="abc")
    assert loaded.depth == 2 and loaded.meta["version"] == lookahead_fit.VERSION
    for layer in (0, 1):
        assert torch.equal(loaded.chances(layer, x, routed), maps.chances(layer, x, routed))
    with pytest.raises(ValueError, match="fingerprint"):
        lookahead_fit.load(path, fingerprint="other")


def test_learned_maps_wrap_to_the_next_tokens_first_layers(tmp_path) -> None:
    """The next token's layer-0 experts are a fixed function of this token's last-layer input: the maps
    from the last layers learn them, and the depth that wraps is judged against the next token."""
    rng = np.random.default_rng(5)
    n, hidden, experts = 900, 8, 6
    x = rng.standard_normal((n, 3, hidden)).astype(np.float32)
    projection = rng.standard_normal((hidden, experts)).astype(np.float32)
    ids = rng.integers(0, experts, (n, 3, 2)).astype(np.int64)
    sequence = np.arange(n) // 10
    follows = np.flatnonzero(sequence[1:] == sequence[:-1])  # rows whose next row is their next token
    ids[follows + 1, 0] = np.argsort(-(x[follows, 2] @ projection), axis=1)[:, :2]
    assert np.array_equal(lookahead_fit.next_token(HiddenRecords(x, ids, sequence))[follows], follows + 1)
    train, test = HiddenRecords(x, ids, sequence).split(0.25)
    maps = lookahead_fit.fit(train, experts, depth=2, steps=300, wrap=True)
    assert maps.wraps and set(maps.first) == {0, 1, 2}
    last = torch.from_numpy(test.hidden[:, 2])
    assert maps.chances(2, last, torch.from_numpy(test.ids[:, 2])).shape == (2, len(last), experts)
    wrapped = lookahead_fit.slot_quality(maps.predict, test, experts, 1, threshold=0.3, wrap=True)
    assert wrapped[1]["recall"] > 0.85 and wrapped[1]["precision"] > 0.6
    # judged against the same token's layer 0 instead (what a predictor that does not wrap would be
    # scored on), the same chances are near chance level
    same_token = HiddenRecords(test.hidden, test.ids, np.arange(len(test.sequence)))
    shuffled = lookahead_fit.slot_quality(maps.predict, HiddenRecords(
        test.hidden, np.roll(test.ids, 1, axis=0), test.sequence), experts, 1, threshold=0.3, wrap=True)
    assert shuffled[1]["recall"] < 0.6
    assert lookahead_fit.slot_quality(maps.predict, same_token, experts, 1, threshold=0.3, wrap=True) == {}
    loaded = lookahead_fit.load(lookahead_fit.save(maps, tmp_path / "m.lookahead.safetensors"))
    assert loaded.wraps and torch.equal(loaded.chances(2, last, None), maps.chances(2, last, None))


def test_learned_predictor_uses_the_layers_own_routing() -> None:
    """Layer 1's experts follow layer 0's (a fixed permutation) and the router inputs are noise: only the
    routing feature carries the signal, and the fit finds it (chance: recall 2/6 at most 1/3 precision)."""
    rng = np.random.default_rng(3)
    n, experts = 800, 6
    ids = np.stack([rng.permutation(experts)[:2] for _ in range(n)])  # [N, 2]
    routed = np.stack([ids, (ids + 1) % experts], axis=1)  # [N, 2 layers, 2]
    records = HiddenRecords(rng.standard_normal((n, 2, 8)).astype(np.float32), routed, np.arange(n) // 10)
    train, test = records.split(0.25)
    maps = lookahead_fit.fit(train, experts, depth=1, steps=300)
    quality = lookahead_fit.slot_quality(maps.predict, test, experts, 1, threshold=0.3)
    assert quality[1]["recall"] > 0.9 and quality[1]["precision"] > 0.8
    blind = lookahead_fit.slot_quality(lambda layer, d, hidden, _: maps.predict(layer, d, hidden, None),
                                       test, experts, 1, threshold=0.3)
    assert blind[1]["recall"] < 0.7  # without the routing the same predictor is near chance


def test_learned_predictor_pads_to_an_inflated_hidden_size() -> None:
    records = synthetic_records()
    maps = lookahead_fit.fit(records, 6, depth=1, steps=20)
    wide = maps.padded(20)
    x, routed = torch.from_numpy(records.hidden[:5, 0]), torch.from_numpy(records.ids[:5, 0])
    padded_x = torch.cat([x, torch.zeros(5, 12)], dim=1)
    assert wide.meta["hidden_size"] == 20
    torch.testing.assert_close(wide.chances(0, padded_x, routed), maps.chances(0, x, routed))
    with pytest.raises(ValueError, match="hidden size"):
        maps.padded(4)


def test_an_old_or_foreign_predictor_file_is_refused_with_a_clear_message(tmp_path) -> None:
    import json

    from safetensors.torch import save_file

    old = tmp_path / "old.lookahead.safetensors"
    save_file({"weight.0.1": torch.zeros(6, 8), "bias.0.1": torch.zeros(6)}, str(old),
              metadata={"moeinf": json.dumps({"format": lookahead_fit.FORMAT, "version": 1})})
    with pytest.raises(ValueError, match="version 1.*re-run `moeinf trace`"):
        lookahead_fit.load(old)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"x": torch.zeros(1)}, str(foreign))
    with pytest.raises(ValueError, match="not a moeinf look-ahead predictor"):
        lookahead_fit.load(foreign)


def test_lookahead_chances_skip_padding_and_fall_back_to_routers() -> None:
    records = synthetic_records()
    maps = lookahead_fit.fit(records, 6, depth=1, steps=50)
    look = Lookahead(2, 6, maps)
    x, routed = torch.from_numpy(records.hidden[:4, 0]), torch.from_numpy(records.ids[:4, 0])
    # depth 1 from the learned map, depth 2 has neither map nor routers: one row
    assert look.chances(0, x, None, routed).shape == (1, 6)
    assert look.chances(0, x, torch.zeros(4, dtype=torch.bool), routed) is None
    only_first = look.chances(0, x, torch.tensor([True, False, False, False]), routed)
    np.testing.assert_allclose(only_first[0], maps.predict(0, 1, x[:1], routed[:1])[0].numpy(), rtol=1e-6)


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
    # the expert transitions of the traced routing, beside the EAMC too
    from moeinf.runtime.lookahead import transitions_path

    assert result["transitions"]["out"] == str(transitions_path(out)) and result["transitions"]["depth"] == 2
    with MoE(model_dir, config) as moe:
        assert moe._runtime.offloader.lookahead.learned is not None
        assert moe._runtime.offloader.lookahead.transitions is not None
        assert_exact(moe, model_dir, False)
    with pytest.raises(ConfigError, match="lookahead_predictor"):
        MoE(model_dir, config.replace(lookahead_predictor=str(tmp_path / "missing.safetensors")))


@pytest.mark.parametrize("family", ROUTED_FAMILIES)
def test_first_layer_guess_is_the_first_router_on_each_token_embedding(family: str, tiny_model_dir) -> None:
    model = reference(tiny_model_dir(family))
    spec = spec_for(model.config.model_type)
    names = [site.name for site in experts_sites(model, spec)]
    routers = routers_of(model)
    guess = FirstLayerGuess.build(model, names[0], routers[0], rows_per_step=7)
    decoder_layer = names[0].rsplit(".", 2)[0]
    if not decoder_layer.endswith(".0"):  # dense layers first: no guess from the embedding alone
        assert guess is None
        return
    assert guess is not None
    norm = dict(model.named_modules())[f"{decoder_layer}.post_attention_layernorm"]
    with torch.no_grad():
        _, _, index = routers[0](norm(model.get_input_embeddings().weight))  # [V, k]
    assert torch.equal(guess.table, index.to(torch.int64)) and guess.later is None  # no learned maps
    logits = torch.zeros(2, 3, guess.table.shape[0])  # [B, S, V]
    logits[0, -1, 5] = logits[1, -1, 9] = 1.0
    logits[1, 0, 4] = 2.0  # not the last position: not the next token
    assert guess.layers(logits) == [sorted(set(index[[5, 9]].reshape(-1).tolist()))]


def random_maps(hidden: int, num_experts: int, depth: int, layers: int,
                units: int = 16) -> lookahead_fit.LearnedMaps:
    """Learned maps of random weights from every layer but the last (what they predict is arbitrary)."""
    g = torch.Generator().manual_seed(3)
    first, second = {}, {}
    for layer in range(layers - 1):
        d = min(depth, layers - 1 - layer)
        first[layer] = (torch.randn(units, hidden + num_experts, generator=g),
                        torch.randn(units, generator=g))
        second[layer] = (torch.randn(d * num_experts, units, generator=g),
                         torch.randn(d * num_experts, generator=g))
    return lookahead_fit.LearnedMaps(first, second, {"depth": depth, "num_experts": num_experts,
                                                      "num_layers": layers, "hidden_size": hidden})


def test_the_guess_of_later_layers_is_the_learned_maps_of_the_first_on_each_embedding(tiny_model_dir) -> None:
    """With a learned predictor, layers 1..G of the next token are the top-k of the first layer's maps run
    on each token's normed embedding and its guessed first-layer routing; never deeper than the maps."""
    model = reference(tiny_model_dir("qwen3_moe"))
    spec = spec_for(model.config.model_type)
    names = [site.name for site in experts_sites(model, spec)]
    routers = routers_of(model)
    num_experts, k = model.config.num_experts, model.config.num_experts_per_tok
    maps = random_maps(model.config.hidden_size, num_experts, depth=2, layers=len(names))
    guess = FirstLayerGuess.build(model, names[0], routers[0], rows_per_step=7, learned=maps, layers=5)
    assert guess is not None and guess.later is not None
    norm = dict(model.named_modules())[f"{names[0].rsplit('.', 2)[0]}.post_attention_layernorm"]
    with torch.no_grad():
        normed = norm(model.get_input_embeddings().weight)
        _, _, index = routers[0](normed)
        chances = maps.chances(0, normed, index)  # [2, V, E]: the maps reach 2 layers, fewer than 5 - 1
    assert guess.later.shape == (len(normed), 2, k)
    for depth in (1, 2):
        assert torch.equal(guess.later[:, depth - 1].sort(dim=1).values,
                           chances[depth - 1].topk(k, dim=-1).indices.sort(dim=1).values)
    logits = torch.zeros(1, 2, len(normed))
    logits[0, -1, 11] = 1.0
    assert guess.layers(logits) == [sorted(index[11].tolist()),
                                    *(sorted(guess.later[11, d].tolist()) for d in (0, 1))]
    one = FirstLayerGuess.build(model, names[0], routers[0], learned=maps, layers=1)
    assert one is not None and one.later is None and torch.equal(one.table, guess.table)


def test_demand_reads_go_before_the_plan_and_the_logits_start_the_next_first_layer(tiny_model_dir,
                                                                                   tmp_path) -> None:
    """Within each MoE layer the misses are submitted at MAX priority before any prefetch of that layer's
    plan; between passes, the next token's first-layer experts are submitted (at GUESS_PRIORITY) after the
    last MoE layer and before the next pass's first one."""
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache=0.3, prefetch="hybrid",
                           lookahead_predictor="routers")
    with MoE(tiny_model_dir("qwen3_moe"), config) as moe:
        runtime = moe._runtime
        tier, offloader, top = runtime.cache.tier, runtime.offloader, runtime.cache.max_priority
        assert runtime.next_token_hook is not None
        log: list[tuple[str, tuple[int, int] | int, float]] = []
        submit, run_layer = tier.submit, offloader.run_layer

        def spy_submit(key: tuple[int, int], priority: float) -> None:
            log.append(("submit", key, priority))
            submit(key, priority)

        def spy_run_layer(layer: int, *args: object, **kwargs: object) -> torch.Tensor:
            offloader.settle()  # the previous layer's plan, when the planner thread made it, is that layer's
            log.append(("layer", layer, 0.0))
            return run_layer(layer, *args, **kwargs)

        tier.submit, offloader.run_layer = spy_submit, spy_run_layer
        ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(2))
        moe.generate(ids, max_new_tokens=8, do_sample=False)
    segments: list[list[tuple[str, tuple[int, int] | int, float]]] = []
    for entry in log:
        if entry[0] == "layer":
            segments.append([entry])
        elif segments:
            segments[-1].append(entry)
    mixed = 0
    for segment in segments:
        submits = [(key, p) for op, key, p in segment if op == "submit" and p != GUESS_PRIORITY]
        if any(p == top for _, p in submits) and any(p < top for _, p in submits):
            mixed += 1
            assert submits[0][1] == top, segment
    assert mixed > 0
    last = offloader.num_layers - 1
    guessed = [i for i, segment in enumerate(segments)
               if any(op == "submit" and p == GUESS_PRIORITY for op, _, p in segment)]
    assert guessed
    for i in guessed:
        assert segments[i][0][1] == last and (i + 1 == len(segments) or segments[i + 1][0][1] == 0)
        assert all(key[0] == 0 for op, key, p in segments[i] if op == "submit" and p == GUESS_PRIORITY)


def assert_exact_unequal_prompts(moe: MoE, ref) -> None:
    """Greedy tokens and logits of two prompts of 9 and 5 tokens (the shorter one left-padded) equal the
    unmodified model's `ref`."""
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    with torch.inference_mode():
        assert torch.equal(moe.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False),
                           ref.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False))
        assert torch.equal(moe(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits)


def spy_guesses(tier, layers: int) -> list[tuple[tuple[int, int], float]]:
    """The (key, priority) of every read `tier` is asked for at a guess priority of `layers` layers."""
    guessed: list[tuple[tuple[int, int], float]] = []
    submit = tier.submit

    def spy_submit(key: tuple[int, int], priority: float) -> None:
        if GUESS_PRIORITY - layers * GUESS_STEP < priority <= GUESS_PRIORITY:
            guessed.append((key, priority))
        submit(key, priority)

    tier.submit = spy_submit
    return guessed


def test_the_logits_start_the_next_passs_first_layers_layer_by_layer(tiny_model_dir, tmp_path) -> None:
    """With a learned predictor the guess reaches past the first MoE layer: after the last MoE layer of a
    pass, layer d's guessed experts are submitted at GUESS_PRIORITY - d x GUESS_STEP (above every plan), as
    deep as `lookahead_next_token_layers`; the tokens and logits stay exact, in bf16 with top-8 routing and
    a batch of unequal prompts."""
    from moeinf.store.fingerprint import fingerprint

    model_dir = tiny_model_dir("qwen3_moe", dtype="bfloat16", num_experts=32, num_experts_per_tok=8)
    store_dir = tmp_path / "store"
    # a cache whose prefetch window (a quarter of its slots) leaves room past the first layer's guess
    config = OffloadConfig(offload_dir=str(store_dir), device_cache=0.6, prefetch="hybrid",
                           lookahead_predictor="routers")
    MoE(model_dir, config).close()  # packs the store: the maps carry its fingerprint
    model = reference(model_dir)
    assert model.dtype == torch.bfloat16
    layers = len(routers_of(model))
    maps = random_maps(model.config.hidden_size, model.config.num_experts, depth=3, layers=layers)
    path = lookahead_fit.save(maps, tmp_path / "m.lookahead.safetensors",
                              {"fingerprint": fingerprint(model_dir)})
    for depth in (2, 1):
        with MoE(model_dir, config.replace(lookahead_predictor=str(path),
                                           lookahead_next_token_layers=depth)) as moe:
            guessed = spy_guesses(moe._runtime.cache.tier, depth)
            assert_exact_unequal_prompts(moe, model)
            assert (moe._runtime.offloader.lookahead.first_layer.later is None) == (depth == 1)
        assert {key[0] for key, _ in guessed} == set(range(depth))
        assert all(p == GUESS_PRIORITY - key[0] * GUESS_STEP for key, p in guessed)


@pytest.mark.parametrize("hold", [True, False])
def test_a_layer_the_latest_plan_serves_makes_no_plan_and_tokens_stay_exact(hold: bool, tiny_model_dir,
                                                                            tmp_path) -> None:
    """With `prefetch_hold_plan`, a layer whose experts are all resident, with no read in flight and every
    key the latest plan wanted held, skips the look-ahead; every other layer predicts and plans as before."""
    model_dir = tiny_model_dir("deepseek_v3")
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache=0.8, prefetch="hybrid",
                           lookahead_predictor="routers", prefetch_hold_plan=hold)
    with MoE(model_dir, config) as moe:
        offloader, cache = moe._runtime.offloader, moe._runtime.cache
        calls: list[bool] = []  # per layer: whether it predicted (called the look-ahead)
        ahead, held = offloader._ahead, offloader._held

        def spy_held(needed: list[tuple[int, int]]) -> bool:
            result = held(needed)
            if result:  # what the skip relies on, checked when it is taken
                assert all(key in cache.resident for key in needed) and cache.holds(offloader._wanted)
                assert not cache.in_flight
            calls.append(not result)
            return result

        def spy_ahead(*args: object) -> object:
            assert calls[-1], "a held layer must not predict"
            return ahead(*args)

        offloader._held, offloader._ahead = spy_held, spy_ahead
        assert_exact(moe, model_dir, False)
        stats = moe.stats()
    assert stats["plans_held"] == calls.count(False)
    assert (stats["plans_held"] > 0) == hold
    assert calls.count(True) > 0


@pytest.mark.parametrize("plan_thread", [True, False])
def test_layers_with_nothing_to_read_plan_on_the_planner_thread_and_tokens_stay_exact(plan_thread: bool,
                                                                                     tiny_model_dir,
                                                                                     tmp_path) -> None:
    """With `prefetch_plan_thread`, a layer whose experts are all resident plans on the planner thread while
    its experts compute (and a layer that waits for a read plans on the compute thread); the next layer
    starts only after that plan is in. Without it every plan is made on the compute thread."""
    import threading

    model_dir = tiny_model_dir("deepseek_v3")
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache=0.6, prefetch="hybrid",
                           lookahead_predictor="routers", prefetch_hold_plan=False,
                           prefetch_plan_thread=plan_thread)
    with MoE(model_dir, config) as moe:
        offloader = moe._runtime.offloader
        threads: list[str] = []
        plan, run_layer = offloader._plan, offloader.run_layer

        def spy_plan(*args: object) -> object:
            threads.append(threading.current_thread().name)
            return plan(*args)

        def spy_run_layer(*args: object, **kwargs: object) -> torch.Tensor:
            out = run_layer(*args, **kwargs)
            threads.append("layer done")
            return out

        offloader._plan, offloader.run_layer = spy_plan, spy_run_layer
        assert_exact(moe, model_dir, False)
        stats = moe.stats()
        assert offloader._pending is None  # nothing runs on after a call
    on_planner = sum(name.startswith("moeinf-plan") for name in threads)
    assert (on_planner > 0) == plan_thread
    assert stats["plans_beside_compute"] == on_planner
    assert threads.count(threading.main_thread().name) > 0  # the layers that waited for a read
    assert stats["prefetches"] > 0


def test_an_error_on_the_planner_thread_reaches_the_caller_and_the_model_stays_usable(tiny_model_dir,
                                                                                      tmp_path) -> None:
    model_dir = tiny_model_dir("deepseek_v3")
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache=0.9, prefetch="hybrid",
                           lookahead_predictor="routers", prefetch_hold_plan=False)
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    with MoE(model_dir, config) as moe:
        offloader = moe._runtime.offloader
        expected = moe.generate(ids, max_new_tokens=6, do_sample=False)
        plan_now = offloader._plan_and_prefetch_now

        def failing(*args: object) -> None:
            raise RuntimeError("planner failed")

        offloader._plan_and_prefetch_now = failing
        with pytest.raises(RuntimeError, match="planner failed"):
            moe.generate(ids, max_new_tokens=6, do_sample=False)
        offloader._plan_and_prefetch_now = plan_now
        assert torch.equal(moe.generate(ids, max_new_tokens=6, do_sample=False), expected)


@pytest.mark.parametrize(("cache", "guesses"), [(1.0, False), (0.3, True)])
def test_the_next_token_is_guessed_only_while_some_expert_is_not_in_the_cache(cache: float, guesses: bool,
                                                                              tiny_model_dir, tmp_path,
                                                                              monkeypatch) -> None:
    """A cache that holds every expert has nothing to read ahead: the logits' guess is not even made."""
    made = []
    layers = FirstLayerGuess.layers
    monkeypatch.setattr(FirstLayerGuess, "layers",
                        lambda self, logits: made.append(1) or layers(self, logits))
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache=cache, prefetch="hybrid",
                           lookahead_predictor="routers")
    with MoE(tiny_model_dir("qwen3_moe"), config) as moe:
        ids = torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(0))
        moe.generate(ids, max_new_tokens=2, do_sample=False)  # the first pass fills the cache
        made.clear()
        moe.generate(ids, max_new_tokens=6, do_sample=False)
    assert bool(made) == guesses


def test_transitions_beside_the_eamc_predict_where_no_router_or_map_does(tmp_path) -> None:
    from moeinf.policy.lookahead import Transitions
    from moeinf.runtime.lookahead import load_transitions, save_transitions, transitions_path

    ids = np.stack([np.stack([np.arange(4) % 6, (np.arange(4) + 1) % 6], axis=1)] * 3, axis=1)  # [T, L, k]
    ids[:, 1] = (ids[:, 0] + 2) % 6
    ids[:, 2] = (ids[:, 1] + 2) % 6
    fitted = Transitions.fit([ids] * 3, 3, 6, depth=2)
    path = save_transitions(fitted, transitions_path(tmp_path / "x.eamc"), fingerprint="a" * 64)
    assert path == tmp_path / "x.transitions.npz"
    loaded = load_transitions(path, fingerprint="a" * 64)
    np.testing.assert_array_equal(loaded.cond, fitted.cond)
    with pytest.raises(ValueError, match="another model"):
        load_transitions(path, fingerprint="b" * 64)
    np.savez(tmp_path / "other.npz", x=np.zeros(1))
    with pytest.raises(ValueError, match="not a moeinf transitions file"):
        load_transitions(tmp_path / "other.npz")
    look = Lookahead(3, 6)
    assert not look.ready
    look.transitions = loaded
    assert look.ready
    hidden, routed = torch.zeros(2, 4), torch.tensor([[0, 1], [2, 3]])
    chances = look.chances(0, hidden, None, routed)  # depths 1 and 2: the transitions know no more
    assert chances.shape == (2, 6)
    assert set(np.flatnonzero(chances[0] > 0.5)) == {2, 3, 4, 5}
    only_first = look.chances(0, hidden, torch.tensor([True, False]), routed)
    assert set(np.flatnonzero(only_first[0] > 0.5)) == {2, 3}
    assert look.chances(0, hidden, None, None) is None  # no routing: nothing to follow


def test_lookahead_joins_the_earlier_layers_of_the_same_pass(tmp_path) -> None:
    from moeinf.policy.lookahead import Transitions
    from moeinf.runtime.lookahead import load_transitions, save_transitions, transitions_path

    rng = np.random.default_rng(0)
    routing = []
    for _ in range(10):  # layer 2 routes to 2a + b after a at layer 0 and b at layer 1 (top-1, 4 experts)
        a, b = rng.integers(0, 2, size=(2, 60))
        routing.append(np.stack([a, b, 2 * a + b], axis=1)[:, :, None])
    path = save_transitions(Transitions.fit(routing, 3, 4, depth=2, sources=2),
                            transitions_path(tmp_path / "x.eamc"), fingerprint="a" * 64)
    loaded = load_transitions(path, fingerprint="a" * 64)
    assert loaded.sources == 2
    hidden = torch.zeros(1, 4)

    def chances(look: Lookahead, layer: int, expert: int) -> np.ndarray:
        return look.chances(layer, hidden, None, torch.tensor([[expert]]))[0]

    look = Lookahead(1, 4, transition_layers=3)
    look.transitions = loaded
    look.note(0, torch.tensor([[1]]))  # a = 1
    look.note(1, torch.tensor([[0]]))  # b = 0
    assert chances(look, 1, 0).argmax() == 2 and chances(look, 1, 0)[2] > 0.9
    # a new pass that has not reached layer 1: the previous pass's layer 0 is not this token's
    look.note(0, torch.tensor([[0]]))
    assert np.sum(chances(look, 1, 0) > 0.3) == 2  # expert 0 or 2: layer 1 alone
    look.note(1, torch.tensor([[0]]))
    assert chances(look, 1, 0).argmax() == 0 and chances(look, 1, 0)[0] > 0.9  # a = 0 this pass
    # padding left out of the earlier layer as out of the current one
    look.note(0, torch.tensor([[1], [0]]))
    look.note(1, torch.tensor([[1], [1]]))
    masked = look.chances(1, torch.zeros(2, 4), torch.tensor([True, False]), torch.tensor([[1], [1]]))
    assert masked[0].argmax() == 3 and masked[0, 1] < 0.1  # the real token: a = 1, b = 1
    one = Lookahead(1, 4, transition_layers=1)  # the setting keeps one layer
    one.transitions = loaded
    one.note(0, torch.tensor([[1]]))
    one.note(1, torch.tensor([[0]]))
    assert np.sum(chances(one, 1, 0) > 0.3) == 2
    # a file of the previous version (one layer) loads and predicts from one layer
    with np.load(path) as data:
        np.savez(tmp_path / "old.transitions.npz", cond=data["cond"], calibration=data["calibration"],
                 meta=data["meta"])
    old = load_transitions(tmp_path / "old.transitions.npz", fingerprint="a" * 64)
    assert old.sources == 1 and old.prior is None
    np.testing.assert_array_equal(old.cond, loaded.cond)
