from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeinf import zoo
from moeinf.zoo.answers import chosen_option, content_words, main, overlaps, score
from moeinf.zoo.corpus import Example

QUESTION = "Which colour is grass?\nA. red\nB. green\nC. blue\nD. black\nAnswer:"


def test_overlap_needs_a_content_word_or_a_number_of_the_prompt() -> None:
    assert content_words("Write about the ocean and these waves") == {"ocean", "waves"}
    assert overlaps("Write a poem about the ocean.", "The ocean is deep.")
    assert not overlaps("Write a poem about the ocean.", "Die Kaßen, dass die Kragen")
    assert not overlaps("Write a poem about the ocean.", "There would be these, which")  # function words only
    assert overlaps("Tom has 17 apples.", "17 - 5 = 12")
    assert not overlaps("Tom has 17 apples.", "5 + 6 = 11")


def test_chosen_option_reads_letter_or_option_text() -> None:
    assert chosen_option(QUESTION, "B. green") == "B"
    assert chosen_option(QUESTION, "D") == "D"
    assert chosen_option(QUESTION, "green, of course") == "B"
    assert chosen_option(QUESTION, "Die Kaßen") is None


def test_score_groups_by_task() -> None:
    examples = [Example("m/0", "knowledge_qa", QUESTION, "B"), Example("m/1", "knowledge_qa", QUESTION, "B"),
                Example("g/0", "math", "Tom has 17 apples and eats 5.", "12")]
    by_task = score(examples, ["B. green", "A. red", "He eats 5 apples"])
    assert by_task["knowledge_qa"] == {"prompts": 2, "overlap": 0.5, "names_an_option": 1.0,
                                       "right_option": 0.5}
    assert by_task["math"] == {"prompts": 1, "overlap": 1.0, "uses_a_question_number": 1.0}


def test_answers_run_on_the_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = zoo.get_model("tiny", cache_dir=tmp_path, progress=False)
    assert main([str(model), "--per-file", "1", "--max-new-tokens", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["by_task"]) == {"math", "knowledge_qa", "conversation", "instruction"}
    assert len(report["answers"]) == 4
    assert main([str(tmp_path / "absent")]) == 2
