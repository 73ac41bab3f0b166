"""Training text and held-out prompts for the zoo models, from the prompt sets shipped in moeinf/data/prompts.

The split is by file, so no held-out prompt can leak into training. Two corpora:

- "mixed" (the benchmark model `full`): GSM8K train, MMLU (dev and test), the Self-Instruct seed tasks
  and NTREX translations (each prompt followed by its reference answer); held out: GSM8K test, MT-Bench
  and the user-oriented Self-Instruct set (whose authors ask that it never be trained on).
- "qa" (the demo model): the kinds of question a model of a few million parameters can learn to answer on
  topic. GSM8K train, MMLU dev and test parts 1-2 with the chosen option written out ("B. 1", not "B"), and
  the Self-Instruct seed tasks four times over; no translations (whose targets taught the mixed model to
  drift into German). Held out: GSM8K test, MMLU test part 3 and the two sets held out above.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "data" / "prompts"

TRAIN_FILES: tuple[str, ...] = (
    "gsm8k_train_part1.jsonl",
    "gsm8k_train_part2.jsonl",
    "mmlu_dev.jsonl",
    "mmlu_test_part1.jsonl",
    "mmlu_test_part2.jsonl",
    "mmlu_test_part3.jsonl",
    "self_instruct_seed.jsonl",
    "ntrex_eng-deu.jsonl",
    "ntrex_eng-rus.jsonl",
    "ntrex_eng-zho-CN.jsonl",
)
HELDOUT_FILES: tuple[str, ...] = (
    "gsm8k_test.jsonl",
    "mt_bench.jsonl",
    "self_instruct_user_oriented.jsonl",
)


@dataclass(frozen=True)
class Corpus:
    """Which prompt files a zoo model trains on (each repeated `repeats` times) and which are held out."""

    train: tuple[tuple[str, int], ...]
    heldout: tuple[str, ...]
    mmlu_choice_text: bool = False
    """Answer an MMLU question with the chosen option's line ("B. 1") rather than its letter."""
    demo: tuple[str, ...] = ()
    """The held-out files `moeinf demo` asks from (empty: all of `heldout`)."""


CORPORA: dict[str, Corpus] = {
    "mixed": Corpus(train=tuple((name, 1) for name in TRAIN_FILES), heldout=HELDOUT_FILES),
    "qa": Corpus(
        train=(("gsm8k_train_part1.jsonl", 1), ("gsm8k_train_part2.jsonl", 1), ("mmlu_dev.jsonl", 1),
               ("mmlu_test_part1.jsonl", 1), ("mmlu_test_part2.jsonl", 1), ("self_instruct_seed.jsonl", 4)),
        heldout=("gsm8k_test.jsonl", "mmlu_test_part3.jsonl", "mt_bench.jsonl",
                 "self_instruct_user_oriented.jsonl"),
        mmlu_choice_text=True,
        # Open-ended requests (MT-Bench, user-oriented Self-Instruct) are beyond a model of this size:
        # python -m moeinf.zoo.answers measures how far (moeinf/zoo/weights/demo/README.md).
        demo=("gsm8k_test.jsonl", "mmlu_test_part3.jsonl")),
}


@dataclass(frozen=True)
class Example:
    """One prompt and, for training examples, the answer the model learns to give."""

    id: str
    task: str
    prompt: str
    answer: str | None


def read_examples(file_name: str, prompts_dir: Path = PROMPTS_DIR) -> list[Example]:
    """All rows of one prompt file. MT-Bench's `reference` is a list (one per turn): the first is kept."""
    path = prompts_dir / file_name
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} is missing; the zoo corpus needs moeinf/data/prompts "
                                "as shipped with the package")
    examples = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            reference = row.get("reference")
            if isinstance(reference, list):
                reference = reference[0] if reference else None
            examples.append(Example(row["id"], row["task"], row["prompt"], reference))
    return examples


def with_choice_text(example: Example) -> Example:
    """An MMLU example whose answer is its chosen option's whole line ("B. 1"); others unchanged."""
    if example.task != "knowledge_qa" or not example.answer:
        return example
    prefix = f"{example.answer.strip()}. "
    for line in example.prompt.splitlines():
        if line.startswith(prefix):
            return Example(example.id, example.task, example.prompt, line.strip())
    return example


def training_examples(prompts_dir: Path = PROMPTS_DIR, corpus: str = "mixed") -> list[Example]:
    """Every training example of `corpus` that has an answer, in file order (repeated files repeated)."""
    spec = CORPORA[corpus]
    examples = [ex for name, repeats in spec.train for _ in range(repeats)
                for ex in read_examples(name, prompts_dir) if ex.answer]
    return [with_choice_text(ex) for ex in examples] if spec.mmlu_choice_text else examples


def heldout_prompts(per_file: int | None = None, *, seed: int = 0,
                    prompts_dir: Path = PROMPTS_DIR, corpus: str = "mixed") -> list[Example]:
    """Held-out prompts (never trained on); `per_file` draws that many per file at random (seeded)."""
    return _draw(CORPORA[corpus].heldout, per_file, seed, prompts_dir)


def demo_prompts(per_file: int, *, seed: int = 0, corpus: str = "mixed") -> list[Example]:
    """The held-out prompts `moeinf demo` asks: `per_file` drawn (seeded) from each of its demo files."""
    spec = CORPORA[corpus]
    return _draw(spec.demo or spec.heldout, per_file, seed, PROMPTS_DIR)


def _draw(files: tuple[str, ...], per_file: int | None, seed: int, prompts_dir: Path) -> list[Example]:
    rng = random.Random(seed)
    chosen: list[Example] = []
    for name in files:
        examples = read_examples(name, prompts_dir)
        if per_file is not None and per_file < len(examples):
            examples = rng.sample(examples, per_file)
        chosen.extend(examples)
    return chosen


def shuffled(examples: list[Example], seed: int) -> Iterator[Example]:
    """The examples in a seeded random order, so packed sequences mix tasks."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    return (examples[i] for i in order)
