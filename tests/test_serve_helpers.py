"""Shared fixtures of the serve/chat/replay tests: a tiny MoE with a tiny word-level tokenizer.

The tokenizer is trained here (tokenizers WordLevel, ids below the tiny model's vocab of 128) and
saved as a PreTrainedTokenizerFast, with or without a chat template, so both prompt paths run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "hello there how are you today",
    "what is the capital of france paris is the capital",
    "one two three four five six seven eight nine ten",
    "please write a short story about a cat and a dog",
    "system user assistant you are a helpful model",
    "math question answer solve for x when x plus two equals five",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {{ eos_token }} "
    "{% endfor %}{% if add_generation_prompt %}assistant : {% endif %}"
)


def make_tokenizer(out_dir: Path, *, chat_template: bool) -> Path:
    """Train a word-level tokenizer on SENTENCES (ids < 128) and save it into `out_dir`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=120, special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    tok.train_from_iterator(SENTENCES + ["< | > : ."], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return out_dir


def load_test_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def tiny_chat_dir(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3_moe checkpoint with a word-level tokenizer that has a chat template."""
    import shutil

    src = tiny_model_dir("qwen3_moe")
    out = tmp_path_factory.mktemp("tiny-chat")
    for f in src.iterdir():
        shutil.copy(f, out / f.name)
    return make_tokenizer(out, chat_template=True)


@pytest.fixture(scope="session")
def tiny_backend(tiny_chat_dir: Path):
    """An HFBackend over the unmodified HF model of `tiny_chat_dir`."""
    from transformers import AutoModelForCausalLM

    from moeinf.serve.backend import HFBackend

    model = AutoModelForCausalLM.from_pretrained(tiny_chat_dir).eval()
    return HFBackend(model, load_test_tokenizer(tiny_chat_dir), name="tiny")


def greedy_alone(backend, prompt_ids: list[int], max_tokens: int, *, ignore_eos: bool = False) -> list[int]:
    """Greedy tokens of one prompt alone: the unmodified HF model re-run on the whole sequence each step."""
    import torch

    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(max_tokens):
            token = int(backend.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            if not ignore_eos and token in backend.eos_token_ids:
                break
    return ids[len(prompt_ids) :]


def test_tokenizer_ids_fit_the_tiny_vocab(tiny_backend) -> None:
    ids = tiny_backend.tokenizer.encode("hello there the quick brown fox", add_special_tokens=True)
    assert ids[0] == 1 and max(ids) < 128
    assert tiny_backend.tokenizer.decode(ids, skip_special_tokens=True) == "hello there the quick brown fox"
