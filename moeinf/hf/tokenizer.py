"""The tokenizer of a model directory, or a documented byte-level fallback when it has none.

    tokenizer, kind = load_tokenizer(model_dir)   # kind: "model" or "byte-fallback"
    ids = tokenizer.encode(text)                  # list[int], with the model's BOS when it has one
    ids = tokenizer(text, return_tensors="pt").input_ids   # [1, T], as with a transformers tokenizer
    text = tokenizer.decode(ids, skip_special_tokens=True)
    prompt = chat_prompt(tokenizer, [{"role": "user", "content": "Hi"}])

"model": the directory holds tokenizer files; `transformers.AutoTokenizer` loads them (errors propagate).
"byte-fallback": it holds none (the tiny test models, checkpoints saved without a tokenizer). Text is
encoded as UTF-8 bytes mapped onto token ids of the model's own vocabulary, skipping its special ids
(pad, bos, eos, decoder start), so every id is one the model can embed:

- "byte" layout, when at least 256 ordinary ids exist: byte b -> the b-th ordinary id;
- "nibble" layout, for smaller vocabularies (at least 32 ordinary ids): byte b -> two ids, the
  (b >> 4)-th ordinary id then the (16 + (b & 15))-th one.

Decoding reverses the map; ids outside it (a model may generate any id) decode to U+FFFD, and special ids
are dropped with `skip_special_tokens` (else rendered as `<bos>`, `<eos>`, `<pad>`). The fallback has no
chat template: `chat_prompt` renders messages in a plain "Role: content" format instead.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json")
REPLACEMENT = "\ufffd"


class ByteTokenizer:
    """UTF-8 bytes <-> ids of a model's vocabulary (see the module docstring for the layouts)."""

    chat_template: str | None = None
    """Never a template: `chat_prompt` renders the plain format for this tokenizer."""

    def __init__(self, vocab_size: int, *, bos_token_id: int | None = None, eos_token_id: int | None = None,
                 pad_token_id: int | None = None, extra_special_ids: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.special_names = {i: n for n, i in (("pad", pad_token_id), ("eos", eos_token_id),
                                                ("bos", bos_token_id)) if i is not None}
        specials = set(self.special_names) | set(extra_special_ids)
        self.all_special_ids = sorted(specials)
        ordinary = [i for i in range(vocab_size) if i not in specials]
        if len(ordinary) >= 256:
            self.layout = "byte"
            self._byte_ids = ordinary[:256]
        elif len(ordinary) >= 32:
            self.layout = "nibble"
            self._byte_ids = ordinary[:32]  # 16 high-nibble ids, then 16 low-nibble ids
        else:
            raise ValueError(f"vocabulary of {vocab_size} ids is too small for the byte-level fallback "
                             "tokenizer (needs 32 ordinary ids); add tokenizer files to the model directory")
        self._index = {token: i for i, token in enumerate(self._byte_ids)}

    @classmethod
    def from_config(cls, config: Any) -> ByteTokenizer:
        """From a transformers config: its vocab size and special token ids."""
        start = getattr(config, "decoder_start_token_id", None)
        extra = [] if start is None else [start]
        eos = config.eos_token_id
        if isinstance(eos, list):
            extra += eos[1:]
            eos = eos[0] if eos else None
        return cls(config.vocab_size, bos_token_id=getattr(config, "bos_token_id", None), eos_token_id=eos,
                   pad_token_id=getattr(config, "pad_token_id", None), extra_special_ids=extra)

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, layout={self.layout!r})"

    def encode(self, text: str, add_special_tokens: bool = True, verbose: bool = True) -> list[int]:
        """Token ids of `text`, preceded by BOS when the model has one and `add_special_tokens`. `verbose`
        is HF's (its warning about a sequence longer than the model's); this tokenizer has no warning."""
        ids = [self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []
        data = text.encode("utf-8")
        if self.layout == "byte":
            ids.extend(self._byte_ids[b] for b in data)
        else:
            for b in data:
                ids.append(self._byte_ids[b >> 4])
                ids.append(self._byte_ids[16 + (b & 15)])
        return ids

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True,
                 return_tensors: str | None = None) -> Any:
        """`tokenizer("text", return_tensors="pt").input_ids`, as with a transformers tokenizer: a
        `BatchEncoding` of `input_ids` and `attention_mask` (texts of a list must encode to equal lengths
        for tensors: this tokenizer does not pad)."""
        from transformers import BatchEncoding

        texts = [text] if isinstance(text, str) else list(text)
        ids = [self.encode(t, add_special_tokens=add_special_tokens) for t in texts]
        if return_tensors is not None and len({len(row) for row in ids}) > 1:
            raise ValueError("the byte-level fallback tokenizer does not pad: give texts of equal encoded "
                             "length, or one text at a time")
        data = {"input_ids": ids, "attention_mask": [[1] * len(row) for row in ids]}
        if isinstance(text, str) and return_tensors is None:
            data = {key: rows[0] for key, rows in data.items()}
        return BatchEncoding(data, tensor_type=return_tensors)

    def decode(self, ids: Sequence[int] | Any, skip_special_tokens: bool = True) -> str:
        """Text of `ids` (a sequence or a 1-D tensor); unmapped ids become U+FFFD."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        pieces: list[str] = []
        data = bytearray()
        high: int | None = None  # a high nibble waiting for its low nibble (nibble layout)
        for token in map(int, ids):
            slot = self._index.get(token)
            if slot is not None and self.layout == "byte":
                data.append(slot)
            elif slot is not None and slot < 16:
                if high is not None:
                    data += REPLACEMENT.encode()
                high = slot
            elif slot is not None:
                if high is None:
                    data += REPLACEMENT.encode()
                else:
                    data.append((high << 4) | (slot - 16))
                    high = None
            else:
                if high is not None:
                    data += REPLACEMENT.encode()
                    high = None
                self._special(token, pieces, data, skip_special_tokens)
        if high is not None:
            data += REPLACEMENT.encode()
        pieces.append(data.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def _special(self, token: int, pieces: list[str], data: bytearray, skip: bool) -> None:
        if token in self.all_special_ids:
            if skip:
                return
            text = f"<{self.special_names.get(token, token)}>"
        else:
            text = REPLACEMENT
        pieces.append(data.decode("utf-8", errors="replace") + text)
        data.clear()


def has_tokenizer_files(model_dir: str | Path) -> bool:
    return any((Path(model_dir) / name).exists() for name in TOKENIZER_FILES)


def load_tokenizer(model_dir: str | Path) -> tuple[Any, str]:
    """`(tokenizer, kind)`: the model's own tokenizer ("model") or the byte fallback ("byte-fallback")."""
    if has_tokenizer_files(model_dir):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir)), "model"
    from transformers import AutoConfig

    tokenizer = ByteTokenizer.from_config(AutoConfig.from_pretrained(str(model_dir)))
    log.info("%s has no tokenizer files (%s); using the byte-level fallback (%s layout)",
             model_dir, ", ".join(TOKENIZER_FILES), tokenizer.layout)
    return tokenizer, "byte-fallback"


def chat_prompt(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> str:
    """The prompt text for a chat: the tokenizer's chat template when it has one, else a plain format:
    one "Role: content" line per message (System/User/Assistant), then "Assistant:"."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines + ["Assistant:"])
