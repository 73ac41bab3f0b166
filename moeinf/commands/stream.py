"""Print the tokens of one `generate` call as they come (a transformers streamer for a batch of one), and
end it at a stop string (`StopAtText`, a stopping criterion reading the stream)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TextIO

import torch
from transformers import StoppingCriteria
from transformers.generation.streamers import BaseStreamer

from moeinf.serve.text import IncrementalText


class TextStream(BaseStreamer):
    """Writes the decoded text of each new token to `out`, holding back an incomplete UTF-8 character.

    transformers calls `put` first with the prompt (or a seq2seq model's decoder start token), which is
    skipped, then once per generated token, then `end`.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int], out: TextIO | None = sys.stdout,
                 stop: Sequence[str] = ()) -> None:
        self.text = IncrementalText(tokenizer, prompt_ids, stop)
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

    @property
    def answer(self) -> str:
        """The text so far, cut before a stop string."""
        return self.text.text

    def _write(self, text: str) -> None:
        if text and self.out is not None:
            self.out.write(text)
            self.out.flush()


class StopAtText(StoppingCriteria):
    """Ends `generate` once the stream has met one of its stop strings (transformers calls the streamer
    before its stopping criteria at every step)."""

    def __init__(self, stream: TextStream) -> None:
        self.stream = stream

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.stream.text.stopped, dtype=torch.bool,
                          device=input_ids.device)
