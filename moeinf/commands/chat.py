"""Interactive terminal chat with a MoE model, streaming its answer as it is generated.

Type a message and press Enter. Commands: /help lists them, /stats prints the expert-cache statistics
and the speed since the start, /reset forgets the conversation, /exit (or Ctrl-D) quits; Ctrl-C stops the
answer being generated. Each answer is followed by its speed (prefill and decode tokens/s). The model runs
in this process with its experts offloaded (OffloadConfig flags below); prompts use the tokenizer's chat
template, or the documented fallback. --temperature 0 answers greedily.

  moeinf chat demo
  moeinf chat path/to/model --device-cache 25% --temperature 0 --stop "User:"
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from moeinf.commands import options
from moeinf.serve.backend import Backend, SamplingParams
from moeinf.serve.text import IncrementalText, encode_chat

HELP = ("commands: /help (this list), /stats (expert-cache statistics), /reset (new conversation), "
        "/exit or Ctrl-D (quit); Ctrl-C stops an answer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_model_argument(parser)
    parser.add_argument("--system", default=None, help="system message starting every conversation")
    options.add_generation_arguments(parser, temperature=0.7)
    options.add_offload_arguments(parser, no_offload=True)


class ChatSession:
    """A conversation with one backend: the history, the prompt it makes, one streamed answer per turn."""

    def __init__(self, backend: Backend, *, system: str | None, params: SamplingParams,
                 stop: tuple[str, ...] = ()):
        self.backend, self.system, self.params, self.stop = backend, system, params, stop
        self.messages: list[dict[str, str]] = []
        self.speed = ""
        """The last answer's speed, one line."""
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def _prompt(self) -> tuple[list[int], int]:
        """(the chat prompt, how many of the oldest messages were dropped from the history for it): the
        oldest turns go while the prompt leaves no room for an answer."""
        dropped = 0
        while True:
            ids = encode_chat(self.backend.tokenizer, self.messages)
            if len(ids) + self.params.max_tokens <= self.backend.context_length:
                return ids, dropped
            first = 1 if self.messages and self.messages[0]["role"] == "system" else 0
            if len(self.messages) - first <= 1:
                raise ValueError(
                    f"the message needs {len(ids)} tokens but the context window is "
                    f"{self.backend.context_length} with --max-new-tokens {self.params.max_tokens}; "
                    "write less or lower --max-new-tokens"
                )
            del self.messages[first]  # a whole turn: a template may refuse a chat that opens with its answer
            dropped += 1
            if len(self.messages) - first > 1 and self.messages[first]["role"] == "assistant":
                del self.messages[first]
                dropped += 1

    def answer(self, text: str, write: Callable[[str], None]) -> str:
        """Add the user's message, stream the answer through `write`, and keep it in the history."""
        self.messages.append({"role": "user", "content": text})
        try:
            prompt, dropped = self._prompt()
        except ValueError:
            self.messages.pop()
            raise
        if dropped:  # the model no longer sees them: say so, once, where it happens
            which = f"{dropped} oldest messages" if dropped > 1 else "oldest message"
            write(f"(the {which} left the conversation to fit the model's context of "
                  f"{self.backend.context_length} tokens)\n")
        decoder = IncrementalText(self.backend.tokenizer, prompt, self.stop)
        parts: list[str] = []
        done: set[int] = set()
        start = time.perf_counter()
        first = start
        tokens = 0
        try:
            for step in self.backend.generate([prompt], [self.params], done):
                for token in step:
                    tokens += 1
                    if tokens == 1:
                        first = time.perf_counter()
                    parts.append(decoder.push(token.token_id, final=token.finish_reason is not None))
                    write(parts[-1])
                    if decoder.stopped:  # a --stop string: the answer ends before it
                        done.add(token.index)
        except KeyboardInterrupt:
            parts.append(decoder.flush())
            write(parts[-1] + " [stopped]")
        end = time.perf_counter()
        self.speed = answer_speed(len(prompt), tokens, first - start, end - first)
        reply = "".join(parts)
        self.messages.append({"role": "assistant", "content": reply})
        return reply


def answer_speed(prompt_tokens: int, tokens: int, prefill_s: float, decode_s: float) -> str:
    """One answer's speed: the prompt's prefill (to the first token) and the decode of the rest."""
    prefill = f"{prompt_tokens / prefill_s:.1f}" if prefill_s > 0 else "-"
    decode = f"{(tokens - 1) / decode_s:.1f}" if tokens > 1 and decode_s > 0 else "-"
    return (f"[{tokens} tokens; prefill {prefill} tokens/s ({prompt_tokens} prompt tokens), "
            f"decode {decode} tokens/s]")


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
            if stats and not stats.get("tokens"):
                write("no answer yet: the statistics start with the first one\n")
            elif stats:
                write(f"{options.speed_line(stats)}\n{options.stats_line(stats)}\n")
            else:
                write("no expert-cache statistics (the model is not offloaded); last answer: "
                      f"{session.speed or 'none yet'}\n")
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
        write(f"\n{session.speed}\n")


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    import readline  # noqa: F401 - line editing and history for input()

    from moeinf.serve.loader import load_backend

    limit = options.context_length(args.model_dir)
    if limit is not None and args.max_new_tokens >= limit:
        raise options.UsageError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a message in "
                                 f"the model's context of {limit} tokens (a conversation and its answer "
                                 f"share it); use {limit // 2} or so, at most {limit - 1}")
    config = None
    if not args.no_offload:
        config = options.offload_config(args, args.model_dir)
        options.ensure_store(args.model_dir, config, progress=True)
    ref = getattr(args.model_dir, "ref", None)
    backend = load_backend(args.model_dir, config, name=ref.name if ref is not None else None)
    params = SamplingParams(
        max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        top_k=args.top_k, repetition_penalty=args.repetition_penalty,
    )
    session = ChatSession(backend, system=args.system, params=params, stop=tuple(args.stop))
    try:
        return chat_loop(session, input, _write)
    finally:
        backend.close()
