"""Text around the tokens: chat prompts, incremental detokenisation and stop strings.

Chat prompts are rendered by `moeinf.hf.tokenizer.chat_prompt`: the tokenizer's own chat template when
it has one (encoded without extra special tokens: the template writes its own BOS), else the project's
documented fallback, one "Role: content" line per message then "Assistant:", e.g.

    System: You are helpful.
    User: Hello!
    Assistant:

encoded with the tokenizer's special tokens (BOS) added.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moeinf.hf.tokenizer import chat_prompt


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_chat(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of a chat prompt ending where the assistant's answer starts."""
    text = chat_prompt(tokenizer, messages)
    # verbose=False: transformers' warning about a sequence longer than the model's; callers check the
    # context themselves (chat drops old turns, the server answers a 400)
    return list(tokenizer.encode(text, add_special_tokens=not has_chat_template(tokenizer), verbose=False))


def encode_text(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=True, verbose=False))  # see encode_chat


class IncrementalText:
    """Turns a stream of token ids into text deltas, honouring stop strings.

    Each step decodes the generated ids after a few prompt tokens of context (so that word-joining
    decoders put the right space before the first word) and emits the new suffix. Text from a
    replacement character on (an incomplete UTF-8 character, which later tokens may complete), or
    that could still become a stop string, is held back until it is decided; a replacement character
    still there `_UTF8_HOLD` tokens later is the model's own invalid byte and is emitted. When a stop
    string appears, the text before it is final and `stopped` is set.
    """

    _UTF8_HOLD = 4  # a UTF-8 character has at most 4 bytes

    _CONTEXT = 4

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.prefix = list(prompt_ids[-self._CONTEXT :])
        self.prefix_text = self._decode(self.prefix)
        self.ids: list[int] = []
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self._held = 0  # tokens pushed while a replacement character held the text back

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def push(self, token_id: int, final: bool = False) -> str:
        """Add a token (`final` on the last one) and return the newly decided text."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        full = self._decode(self.prefix + self.ids)
        # A prompt ending inside a UTF-8 character may be completed by the first tokens: the
        # completed character is then part of the answer.
        base = self.prefix_text if full.startswith(self.prefix_text) else self.prefix_text.rstrip("\ufffd")
        text = full[len(base) :] if full.startswith(base) else self._decode(self.ids)
        for s in self.stop:
            cut = text.find(s)
            if cut >= 0:
                self.stopped, text = True, text[:cut]
        self.text = text
        if self.stopped or final:
            end = len(text)
        else:
            end = max(self.emitted, len(text) - self.hold)
            broken = text.find("\ufffd", self.emitted)
            self._held = self._held + 1 if broken >= 0 else 0
            if broken >= 0 and self._held < self._UTF8_HOLD:
                end = max(self.emitted, min(end, broken))
        delta = text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta

    def flush(self) -> str:
        """Text still held back when the sequence ended without a final token (e.g. cancelled)."""
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta
