"""Interactive terminal chat with a MoE model, streaming its answer as it is generated.

Type a message and press Enter. Commands: /help lists them, /stats prints the expert-cache statistics,
/reset forgets the conversation, /exit (or Ctrl-D) quits; Ctrl-C stops the answer being generated. The
model runs in this process with its experts offloaded (OffloadConfig flags below); prompts use the
tokenizer's chat template, or the documented fallback. --temperature 0 answers greedily.

  moeinf chat path/to/model --device-cache 25% --temperature 0
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from moeinf.commands import options
from moeinf.serve.backend import Backend, SamplingParams
from moeinf.serve.text import IncrementalText, encode_chat

HELP = ("commands: /help (this list), /stats (expert-cache statistics), /reset (new conversation), "
        "/exit or Ctrl-D (quit); Ctrl-C stops an answer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_model_argument(parser)
    parser.add_argument("--system", default=None, help="system message starting every conversation")
    options.add_generation_arguments(parser, max_new_tokens=256, temperature=0.7)
    options.add_offload_arguments(parser, no_offload=True)


class ChatSession:
    """A conversation with one backend: the history, the prompt it makes, one streamed answer per turn."""

    def __init__(self, backend: Backend, *, system: str | None, params: SamplingParams):
        self.backend, self.system, self.params = backend, system, params
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def _prompt(self) -> list[int]:
        """The chat prompt, dropping the oldest turns while it leaves no room for an answer."""
        while True:
            ids = encode_chat(self.backend.tokenizer, self.messages)
            if len(ids) + self.params.max_tokens <= self.backend.context_length:
                return ids
            first = 1 if self.messages and self.messages[0]["role"] == "system" else 0
            if len(self.messages) - first <= 1:
                raise ValueError(
                    f"the message needs {len(ids)} tokens but the context window is "
                    f"{self.backend.context_length} with --max-new-tokens {self.params.max_tokens}; "
                    "write less or lower --max-new-tokens"
                )
            del self.messages[first]

    def answer(self, text: str, write: Callable[[str], None]) -> str:
        """Add the user's message, stream the answer through `write`, and keep it in the history."""
        self.messages.append({"role": "user", "content": text})
        try:
            prompt = self._prompt()
        except ValueError:
            self.messages.pop()
            raise
        decoder = IncrementalText(self.backend.tokenizer, prompt)
        parts: list[str] = []
        done: set[int] = set()
        try:
            for step in self.backend.generate([prompt], [self.params], done):
                for token in step:
                    parts.append(decoder.push(token.token_id, final=token.finish_reason is not None))
                    write(parts[-1])
        except KeyboardInterrupt:
            parts.append(decoder.flush())
            write(parts[-1] + " [stopped]")
        reply = "".join(parts)
        self.messages.append({"role": "assistant", "content": reply})
        return reply


def chat_loop(session: ChatSession, read: Callable[[str], str], write: Callable[[str], None]) -> int:
    """Read messages until /exit or end of input; `read` is `input` in a terminal."""
    write(f"{HELP}\n")
    while True:
        try:
            line = read("> ").strip()
        except EOFError:
            write("\n")
            return 0
        except KeyboardInterrupt:
            write("\n")
            continue
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            session.reset()
            write("(new conversation)\n")
            continue
        if line == "/help":
            write(f"{HELP}\n")
            continue
        if line == "/stats":
            stats = session.backend.stats()
            write(f"{options.stats_line(stats) if stats else 'no statistics (the model is not offloaded)'}\n")
            continue
        if line.startswith("/"):
            write(f"unknown command {line!r}; {HELP}\n")
            continue
        try:
            reply = session.answer(line, write)
        except ValueError as exc:
            write(f"error: {exc}\n")
            continue
        if not reply.strip():  # say so rather than leave blank lines that look like a hang
            write("(empty answer: the model ended it at once or wrote only blank space)")
        write("\n")


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    import readline  # noqa: F401 - line editing and history for input()

    from moeinf.serve.loader import load_backend

    config = None
    if not args.no_offload:
        config = options.offload_config(args, args.model_dir)
        options.ensure_store(args.model_dir, config, progress=sys.stderr.isatty())
    backend = load_backend(args.model_dir, config)
    params = SamplingParams(
        max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    try:
        return chat_loop(ChatSession(backend, system=args.system, params=params), input, _write)
    finally:
        backend.close()
