from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeinf import zoo
from moeinf.cli import main
from moeinf.zoo.corpus import heldout_prompts
from moeinf.zoo.tokenizer import chat_text


@pytest.fixture(scope="module")
def zoo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("demo-cache")
    zoo.get_model("tiny", cache_dir=cache, progress=False)
    return cache


def test_demo_answers_heldout_prompts_like_the_unmodified_model(
        zoo_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("MOEINF_CACHE", str(zoo_cache))
    assert main(["demo", "--variant", "tiny", "--json", "--greedy", "--max-new-tokens", "4"]) == 0
    report = json.loads(capsys.readouterr().out)
    prompts = heldout_prompts(1, seed=0)
    assert [a["id"] for a in report["answers"]] == [ex.id for ex in prompts]

    model_dir = zoo.model_dir("tiny", zoo_cache)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    for answer, example in zip(report["answers"], prompts, strict=True):
        ids = tokenizer(chat_text(example.prompt), add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                      do_sample=False, pad_token_id=tokenizer.pad_token_id)
        assert answer["ids"] == expected[0, ids.shape[1]:].tolist()

    stats = report["stats"]
    assert stats["tokens"] == sum(len(a["ids"]) for a in report["answers"])
    assert stats["accesses"] > 0
    assert stats["hits"] + stats["misses"] == stats["accesses"]
    # The cache holds 25% of the experts, so the demo must have evicted and re-read some.
    assert stats["evictions"] > 0


def test_demo_rejects_conflicting_variants(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--quick", "--variant", "tiny"]) == 2
    assert "disagree" in capsys.readouterr().err
