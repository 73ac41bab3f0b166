"""The batch job's input checks, its resumable answers file and its progress lines (no model)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from moeinf.batch.jobs import Answers, JobError, Prompt, read_prompts
from moeinf.batch.runner import Progress, answer_tokens, pad_batch


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_prompts_are_read_in_file_order_skipping_blank_lines(tmp_path: Path) -> None:
    lines = ['{"id": "a", "prompt": "x", "task": "t"}', "", '{"id": 7, "prompt": "y"}']
    path = write(tmp_path / "p.jsonl", lines)
    assert read_prompts(path) == [Prompt("a", "x"), Prompt(7, "y")]


@pytest.mark.parametrize(("lines", "message"), [
    (['{"id": "a", "prompt": "x"}', '{"id": "b", "prompt": '], ":2: not valid JSON"),
    (['{"id": "a"}'], ":1: missing key 'prompt'"),
    (['{"prompt": "x"}'], ":1: missing key 'id'"),
    (['["a", "x"]'], ":1: a line must be a JSON object"),
    (['{"id": "a", "prompt": "x"}', '{"id": "a", "prompt": "y"}'], ":2: duplicate id 'a' (first on line 1)"),
    (['{"id": 1.5, "prompt": "x"}'], "'id' must be a string or an integer"),
    (['{"id": "a", "prompt": 3}'], "'prompt' must be a string"),
    ([""], "holds no prompts"),
    (['{"id": "a", "prompt": "x", "max_tokens": 3}'],
     ":1: 'max_tokens' is not read per prompt: every prompt is answered with the command's settings"),
    (['{"id": "a", "messages": []}'],
     ":1: missing key 'prompt' (a line holds one plain prompt; chat 'messages' are not read)"),
])
def test_a_bad_prompts_file_names_the_line(tmp_path: Path, lines: list[str], message: str) -> None:
    path = write(tmp_path / "p.jsonl", lines)
    with pytest.raises(JobError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        read_prompts(path)


def test_a_missing_prompts_file_is_one_error(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="no such file"):
        read_prompts(tmp_path / "absent.jsonl")


def test_answers_are_durable_and_a_partial_last_line_is_dropped(tmp_path: Path) -> None:
    out = tmp_path / "out" / "a.jsonl"
    with Answers(out) as answers:
        answers.write("a", "one", tokens=1)
        answers.write(2, "two")
        with pytest.raises(ValueError, match="already answered"):
            answers.write("a", "again")
    with out.open("ab") as f:  # a write cut by a kill
        f.write(b'{"id": "c", "text": "thr')
    with Answers(out) as answers:
        assert answers.dropped_partial
        assert answers.done == {"a", 2}
        prompts = [Prompt("a", ""), Prompt(2, ""), Prompt("c", "")]
        assert answers.pending(prompts) == [Prompt("c", "")]
        answers.write("c", "three")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", 2, "c"]
    assert rows[0] == {"id": "a", "text": "one", "tokens": 1}


def test_an_answers_file_of_something_else_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", ["not json"])
    with pytest.raises(JobError, match="not an answers line"):
        Answers(path)


def test_padding_is_on_the_left_and_answers_stop_at_eos() -> None:
    ids, mask = pad_batch([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert answer_tokens([4, 5, 2, 0, 0], stop=[2]) == [4, 5]
    assert answer_tokens([4, 5], stop=[]) == [4, 5]


def test_progress_prints_periodic_lines_when_not_a_terminal() -> None:
    stream = io.StringIO()
    progress = Progress(total=4, stream=stream, every_s=3600, tty=False)
    progress.update(1, 10)  # the first update always prints
    progress.update(1, 10)  # within every_s: silent
    progress.update(2, 20)  # the end always prints
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("prompts 1/4  10 tokens")
    assert "ETA" in lines[0] and "tok/s" in lines[0]
    assert lines[1].startswith("prompts 4/4  40 tokens")


class _CountingBatch:
    """A running batch without a model: each row yields `new` tokens (its key), joins are recorded."""

    def __init__(self, new: int) -> None:
        self.new, self.rows, self.joins = new, {}, []

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, keys, prompts, params):
        self.joins.append([len(p) for p in prompts])
        self.rows.update({k: 0 for k in keys})
        return self._tokens(keys)

    def step(self):
        return self._tokens(list(self.rows))

    def _tokens(self, keys):
        from moeinf.serve.running import StepToken

        out = []
        for k in keys:
            self.rows[k] += 1
            done = self.rows[k] >= self.new
            out.append(StepToken(k, k, "length" if done else None))
            if done:
                del self.rows[k]
        return out

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("join", "passes"), [(None, [8, 8]), (2, [2, 2, 2, 2, 2, 2, 2, 2])])
def test_prompts_join_in_prefill_passes_of_at_most_join_prompts(join, passes) -> None:
    from moeinf.batch.runner import run_continuous

    class Tokenizer:
        def encode(self, text):
            return [1] * len(text)

        def decode(self, tokens, skip_special_tokens=True):
            return ""

    batch = _CountingBatch(new=3)
    prompts = [Prompt(i, "x" * (i + 1)) for i in range(16)]
    result = run_continuous(lambda: batch, Tokenizer(), prompts, 8, None, join=join)
    assert result.prompts == 16 and result.tokens == 48
    assert [len(j) for j in batch.joins] == passes
    assert sum(batch.joins, []) == list(range(1, 17))  # in order, each prompt once
