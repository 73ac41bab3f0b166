"""Print the tokens of one `generate` call as they come (a transformers streamer for a batch of one)."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from transformers.generation.streamers import BaseStreamer

from moeinf.serve.text import IncrementalText


class TextStream(BaseStreamer):
    """Writes the decoded text of each new token to `out`, holding back an incomplete UTF-8 character.

    transformers calls `put` first with the prompt (or a seq2seq model's decoder start token), which is
    skipped, then once per generated token, then `end`.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int], out: TextIO = sys.stdout) -> None:
        self.text = IncrementalText(tokenizer, prompt_ids)
        self.out = out
        self.prompt_seen = False

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self._write(self.text.push(int(token)))

    def end(self) -> None:
        self._write(self.text.flush())

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()
