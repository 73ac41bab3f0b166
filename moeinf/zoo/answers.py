"""How on topic a zoo model's greedy answers to held-out prompts are, measured on the unmodified HF model.

A model of a few million parameters does not answer correctly; what `moeinf demo` needs is that its answers
be recognisably about the question. Three crude, checkable signs, per held-out file:

- overlap: the answer repeats at least one content word (4+ letters, not a common function word) or
  number of the prompt;
- for multiple-choice questions (MMLU): the answer names one of the listed options ("B. green"), and how
  often that option is the right one (chance is 0.25);
- for math word problems (GSM8K): the answer uses at least one number of the question.

Run as `python -m moeinf.zoo.answers MODEL_DIR [--corpus qa] [--per-file 30] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch

from .corpus import CORPORA, Example, heldout_prompts
from .tokenizer import chat_text

FUNCTION_WORDS = frozenset("""
about above after again against also because been before being below between both could does doing down
during each either every from further have having here into itself just many more most much must neither
only other over same should some such than that their them then there these they this those through under
until very what when where which while whom will with would your yours following given answer write using
""".split())
_WORD = re.compile(r"[A-Za-z]{4,}")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_OPTION = re.compile(r"^([A-D])\. (.+)$", re.MULTILINE)


def content_words(text: str) -> set[str]:
    """The lower-cased words of 4+ letters in `text` that are not common function words."""
    return {w for w in (m.lower() for m in _WORD.findall(text)) if w not in FUNCTION_WORDS}


def numbers(text: str) -> set[str]:
    return set(_NUMBER.findall(text))


def overlaps(prompt: str, answer: str) -> bool:
    """Whether `answer` repeats a content word or a number of `prompt`."""
    return bool(content_words(prompt) & content_words(answer) or numbers(prompt) & numbers(answer))


def chosen_option(prompt: str, answer: str) -> str | None:
    """The letter of the option of `prompt` that `answer` names ("B" or "B. green" at its start), if any."""
    head = answer.strip()
    for letter, text in _OPTION.findall(prompt):
        if head.startswith(f"{letter}. ") or head == letter or head.startswith(text.strip()):
            return letter
    return None


def score(examples: list[Example], answers: list[str]) -> dict[str, Any]:
    """The signs above over `examples` and their `answers`, grouped by task."""
    by_task: dict[str, dict[str, Any]] = {}
    for example, answer in zip(examples, answers, strict=True):
        row = by_task.setdefault(example.task, {"prompts": 0, "overlap": 0})
        row["prompts"] += 1
        row["overlap"] += overlaps(example.prompt, answer)
        if example.task == "knowledge_qa":
            letter = chosen_option(example.prompt, answer)
            row["names_an_option"] = row.get("names_an_option", 0) + (letter is not None)
            right = letter is not None and letter == example.answer
            row["right_option"] = row.get("right_option", 0) + right
        if example.task == "math":
            row["uses_a_question_number"] = (row.get("uses_a_question_number", 0)
                                             + bool(numbers(example.prompt) & numbers(answer)))
    for row in by_task.values():
        for key in [k for k in row if k != "prompts"]:
            row[key] = round(row[key] / row["prompts"], 3)
    return by_task


def greedy_answers(model_dir: str | Path, examples: list[Example], max_new_tokens: int) -> list[str]:
    """The unmodified HF model's greedy answers to `examples`, one prompt at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    answers = []
    with torch.no_grad():
        for example in examples:
            text = chat_text(example.prompt)
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)
            answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moeinf.zoo.answers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", help="zoo checkpoint directory")
    parser.add_argument("--corpus", choices=sorted(CORPORA), default="qa",
                        help="whose held-out files to ask from (default qa: all four held-out sets)")
    parser.add_argument("--per-file", type=int, default=30, help="prompts drawn per held-out file")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0, help="which prompts are drawn")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="one JSON object, with every answer")
    args = parser.parse_args(argv)
    if not Path(args.model_dir).is_dir():
        print(f"error: {args.model_dir} is not a directory", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    examples = heldout_prompts(args.per_file, seed=args.seed, corpus=args.corpus)
    answers = greedy_answers(args.model_dir, examples, args.max_new_tokens)
    report = {"model_dir": str(args.model_dir), "corpus": args.corpus, "per_file": args.per_file,
              "seed": args.seed, "max_new_tokens": args.max_new_tokens, "by_task": score(examples, answers)}
    if args.json:
        report["answers"] = [{"id": ex.id, "answer": a} for ex, a in zip(examples, answers, strict=True)]
        print(json.dumps(report))
    else:
        for task, row in report["by_task"].items():
            print(task, " ".join(f"{k}={v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
