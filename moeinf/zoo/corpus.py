"""Training text and held-out prompts for the zoo model, from the prompt sets shipped in moeinf/data/prompts.

The split is by file, so no held-out prompt can leak into training: the model trains on GSM8K train,
MMLU (dev and test), the Self-Instruct seed tasks and NTREX translations (each prompt followed by its
reference answer), and is evaluated on GSM8K test, MT-Bench and the user-oriented Self-Instruct set
(whose authors ask that it never be trained on).
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


def training_examples(prompts_dir: Path = PROMPTS_DIR) -> list[Example]:
    """Every training example that has an answer, in file order."""
    return [ex for name in TRAIN_FILES for ex in read_examples(name, prompts_dir) if ex.answer]


def heldout_prompts(per_file: int | None = None, *, seed: int = 0,
                    prompts_dir: Path = PROMPTS_DIR) -> list[Example]:
    """Held-out prompts (never trained on); `per_file` draws that many per file at random (seeded)."""
    rng = random.Random(seed)
    chosen: list[Example] = []
    for name in HELDOUT_FILES:
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
