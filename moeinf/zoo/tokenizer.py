"""A byte-level BPE tokenizer trained locally on the zoo corpus, saved as a transformers fast tokenizer.

The saved directory holds `tokenizer.json` and `tokenizer_config.json` (bos/eos/pad and a chat template), so
`AutoTokenizer.from_pretrained(model_dir)` loads it next to the model like any downloaded checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS)

# One turn is `<|role|>\n{content}\n`; an assistant turn ends with EOS, which is where generation stops.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def chat_text(prompt: str, answer: str | None = None) -> str:
    """The text CHAT_TEMPLATE renders for one user turn (and the assistant's answer, when given).

    Training packs thousands of these, so they are formatted here rather than through Jinja; a test checks
    that this agrees with `tokenizer.apply_chat_template`.
    """
    text = f"{BOS}<|user|>\n{prompt}\n<|assistant|>\n"
    if answer is not None:
        text += f"{answer}{EOS}\n"
    return text


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> Any:
    """Train a byte-level BPE on `texts` and save it to `out_dir` as a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} cannot hold the 256 byte tokens and the special tokens; "
                         "use at least 512")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    # Keep byte offsets right for ByteLevel without inserting anything: BOS comes from the chat template.
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer
