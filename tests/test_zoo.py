from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moeinf import zoo
from moeinf.zoo.corpus import (
    CORPORA,
    HELDOUT_FILES,
    PROMPTS_DIR,
    TRAIN_FILES,
    Example,
    demo_prompts,
    heldout_prompts,
    training_examples,
    with_choice_text,
)
from moeinf.zoo.routing_stats import random_routing_fractions, routing_stats, sequence_fractions
from moeinf.zoo.tokenizer import chat_text, train_tokenizer


@pytest.fixture(scope="module")
def tiny_zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` zoo variant (2 layers x 8 experts, a few steps), trained once through the cache."""
    return zoo.get_model("tiny", cache_dir=tmp_path_factory.mktemp("zoo-cache"), progress=False)


def test_split_covers_every_prompt_file_once() -> None:
    shipped = {p.name for p in PROMPTS_DIR.glob("*.jsonl")}
    assert set(TRAIN_FILES).isdisjoint(HELDOUT_FILES)
    assert set(TRAIN_FILES) | set(HELDOUT_FILES) == shipped


def test_no_heldout_prompt_is_trained_on() -> None:
    trained = {ex.prompt for ex in training_examples()}
    heldout = heldout_prompts()
    assert len(heldout) == 1319 + 80 + 252
    assert not trained & {ex.prompt for ex in heldout}


def test_qa_corpus_keeps_its_heldout_files_out_of_training() -> None:
    qa = CORPORA["qa"]
    trained_files = {name for name, _ in qa.train}
    assert trained_files.isdisjoint(qa.heldout)
    assert not any(name.startswith("ntrex") for name in trained_files)
    trained = {ex.prompt for ex in training_examples(corpus="qa")}
    assert not trained & {ex.prompt for ex in heldout_prompts(corpus="qa")}
    # The seed tasks are repeated four times; every other file once.
    seed = [ex for ex in training_examples(corpus="qa") if ex.id.startswith("seed_task_")]
    assert len(seed) == 4 * 175


def test_mmlu_answers_carry_the_chosen_option() -> None:
    question = Example("mmlu/x/0", "knowledge_qa", "Which?\nA. red\nB. green\nC. blue\nAnswer:", "B")
    assert with_choice_text(question).answer == "B. green"
    other = Example("gsm8k/x/0", "math", "2+2?", "4")
    assert with_choice_text(other) == other
    answers = [ex.answer for ex in training_examples(corpus="qa") if ex.task == "knowledge_qa"]
    assert answers and all(a[:3] in {"A. ", "B. ", "C. ", "D. "} for a in answers)
    assert all(ex.answer in "ABCD" for ex in training_examples() if ex.task == "knowledge_qa")


def test_demo_prompts_are_heldout_and_seeded() -> None:
    chosen = demo_prompts(1, seed=3, corpus="qa")
    assert [ex.id for ex in chosen] == [ex.id for ex in demo_prompts(1, seed=3, corpus="qa")]
    heldout = {ex.id for ex in heldout_prompts(corpus="qa")}
    assert {ex.id for ex in chosen} <= heldout
    assert len(chosen) == len(CORPORA["qa"].demo or CORPORA["qa"].heldout)


def test_heldout_sample_is_seeded() -> None:
    first = [ex.id for ex in heldout_prompts(3, seed=1)]
    assert first == [ex.id for ex in heldout_prompts(3, seed=1)]
    assert len(first) == 3 * len(HELDOUT_FILES)


def test_tokenizer_round_trips_and_matches_chat_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    texts = [chat_text(ex.prompt, ex.answer) for ex in training_examples()[::100]]
    train_tokenizer(texts, 600, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    sample = "Übersetze: 48/2 = 24 clips.\n\tПривет, 你好 — done!"
    ids = tokenizer(sample, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == sample
    assert len(tokenizer) == 600
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == chat_text("What is 2+2?", "4")
    prompt_only = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt_only == chat_text("What is 2+2?")
    encoded = tokenizer(chat_text("hi", "ok"), add_special_tokens=False).input_ids
    assert encoded[0] == tokenizer.bos_token_id
    assert tokenizer.eos_token_id in encoded


def test_tiny_training_gives_a_loadable_deepseek_checkpoint(tiny_zoo: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    meta = json.loads((tiny_zoo / "moeinf-zoo.json").read_text())
    assert meta["variant"] == "tiny" and meta["steps"] == 6
    model = AutoModelForCausalLM.from_pretrained(str(tiny_zoo))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_zoo))
    assert model.config.model_type == "deepseek_v3"
    assert model.config.vocab_size == len(tokenizer)
    # Bias balancing moved the selection biases, and they are part of the checkpoint.
    saved = load_file(str(tiny_zoo / "model.safetensors"))
    bias = saved["model.layers.0.mlp.gate.e_score_correction_bias"]
    assert bias.abs().sum() > 0
    torch.testing.assert_close(model.model.layers[0].mlp.gate.e_score_correction_bias, bias)
    ids = tokenizer(chat_text("How many eggs?"), add_special_tokens=False, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 3)


def test_bias_calibration_evens_out_a_skewed_router(tiny_zoo: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moeinf.zoo.train import RECIPES, LoadMeter, calibrate_biases, calibration_texts

    model = AutoModelForCausalLM.from_pretrained(str(tiny_zoo))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_zoo))
    with torch.no_grad():
        model.model.layers[0].mlp.gate.e_score_correction_bias[3] += 0.5  # expert 3 takes every token
    before = model.model.layers[0].mlp.gate.e_score_correction_bias.clone()
    result = calibrate_biases(model, tokenizer, calibration_texts(RECIPES["tiny"], 0, count=40), 64,
                              meter=LoadMeter(model, 8), target=2.0)
    assert result["max_mean_load_before"][0] > 2.0
    assert max(result["max_mean_load_after"]) <= 2.0 < max(result["max_mean_load_before"])
    after = model.model.layers[0].mlp.gate.e_score_correction_bias
    assert after[3] < before[3]  # the busy expert was pushed down
    assert not any(m._forward_hooks for m in model.modules())  # the meter's hooks are gone


def test_routing_stats_run_on_the_tiny_checkpoint(tiny_zoo: Path) -> None:
    prompts = heldout_prompts(1, seed=0)
    stats = routing_stats(tiny_zoo, prompts, max_new_tokens=4)
    assert stats["num_layers"] == 2 and stats["num_experts"] == 8 and stats["top_k"] == 2
    assert stats["prompts"] == 3
    assert len(stats["max_mean_load"]) == 2
    assert all(1.0 <= x <= 8 / 2 * 2 for x in stats["max_mean_load"])
    assert 0.0 < stats["activated_fraction"] <= 1.0
    assert 0.0 <= stats["reused_fraction"] <= 1.0


def test_sequence_fractions_and_random_baseline() -> None:
    eam = np.array([[3, 1, 0, 0], [0, 0, 2, 2]], dtype=np.float32)
    activated, reused = sequence_fractions(eam)
    assert activated == pytest.approx(0.5)
    assert reused == pytest.approx((0.5 + 1.0) / 2)
    act, reuse = random_routing_fractions(tokens=1, top_k=2, num_experts=8)
    assert act == pytest.approx(0.25) and reuse == pytest.approx(0.0)
    act, reuse = random_routing_fractions(tokens=1000, top_k=2, num_experts=64)
    assert act == pytest.approx(1.0) and reuse == pytest.approx(1.0)


def test_get_model_reuses_the_cache(tiny_zoo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moeinf.zoo import train

    def no_training(*args: object, **kwargs: object) -> Path:
        raise AssertionError("get_model retrained a cached model")

    monkeypatch.setattr(train, "train_model", no_training)
    cache = tiny_zoo.parent.parent
    assert zoo.get_model("tiny", cache_dir=cache) == tiny_zoo
    monkeypatch.setenv("MOEINF_CACHE", str(cache))
    assert zoo.get_model("tiny") == tiny_zoo


def test_get_model_refuses_an_incomplete_cache(tmp_path: Path) -> None:
    broken = zoo.model_dir("tiny", tmp_path)
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="--retrain"):
        zoo.get_model("tiny", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown zoo variant"):
        zoo.get_model("huge", cache_dir=tmp_path)


def test_a_recipe_recorded_before_a_field_existed_still_matches(tiny_zoo: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "tiny"
    shutil.copytree(tiny_zoo, copy)
    meta_path = copy / "moeinf-zoo.json"
    meta = json.loads(meta_path.read_text())
    assert zoo.problems(copy, "tiny") == []
    del meta["recipe"]["corpus"]  # as in a checkpoint saved before Recipe.corpus existed
    meta_path.write_text(json.dumps(meta))
    assert zoo.problems(copy, "tiny") == []
    meta["recipe"]["corpus"] = "qa"
    meta_path.write_text(json.dumps(meta))
    assert zoo.problems(copy, "tiny") == [
        "trained with another recipe than moeinf.zoo.train.RECIPES holds now"]
