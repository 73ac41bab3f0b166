"""`moeinf chat`: streamed greedy answers equal the model's, /reset clears the history, Ctrl-D exits."""

from __future__ import annotations

from test_serve_helpers import greedy_alone, tiny_backend, tiny_chat_dir  # noqa: F401

from moeinf.commands.chat import ChatSession, chat_loop
from moeinf.serve.backend import SamplingParams
from moeinf.serve.text import IncrementalText, encode_chat


def _expected(backend, messages, max_tokens: int) -> str:
    ids = encode_chat(backend.tokenizer, messages)
    tokens = greedy_alone(backend, ids, max_tokens)
    text = IncrementalText(backend.tokenizer, ids)
    return "".join(text.push(t, final=i == len(tokens) - 1) for i, t in enumerate(tokens))


def typed(session: ChatSession, lines: list[str]) -> str:
    """What the chat loop writes when `lines` are typed, then Ctrl-D (it must exit 0)."""
    pending = iter(lines)
    out: list[str] = []

    def read(prompt: str) -> str:
        try:
            return next(pending)
        except StopIteration:
            raise EOFError from None

    assert chat_loop(session, read, out.append) == 0
    return "".join(out)


def test_chat_turns_reset_and_eof(tiny_backend) -> None:  # noqa: F811
    session = ChatSession(
        tiny_backend, system="you are a helpful model", params=SamplingParams(max_tokens=5, temperature=0.0)
    )
    lines = ["hello there", "what is the capital", "/reset", "one two", "/bogus"]
    text = typed(session, lines)
    system = {"role": "system", "content": "you are a helpful model"}
    first = _expected(tiny_backend, [system, {"role": "user", "content": "hello there"}], 5)
    history = [
        system,
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "what is the capital"},
    ]
    second = _expected(tiny_backend, history, 5)
    third = _expected(tiny_backend, [system, {"role": "user", "content": "one two"}], 5)
    assert f"{first}\n" in text and f"{second}\n" in text and f"{third}\n" in text
    assert text.index(first) < text.index(second) < text.index("(new conversation)\n") < text.rindex(third)
    assert session.messages == [
        system,
        {"role": "user", "content": "one two"},
        {"role": "assistant", "content": third},
    ]
    assert "unknown command '/bogus'" in text


def test_exit_command(tiny_backend) -> None:  # noqa: F811
    session = ChatSession(tiny_backend, system=None, params=SamplingParams(max_tokens=2, temperature=0.0))
    lines = iter(["/exit", "never read"])
    assert chat_loop(session, lambda _p: next(lines), lambda _t: None) == 0
    assert next(lines) == "never read"


class StubBackend:
    """A model that ends every answer at once (EOS) and reports fixed cache statistics."""

    def __init__(self) -> None:
        from moeinf.hf.tokenizer import ByteTokenizer

        self.tokenizer = ByteTokenizer(300, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        self.context_length = 1000

    def generate(self, prompts, params, done):
        from moeinf.serve.backend import StepToken

        yield [StepToken(0, self.tokenizer.eos_token_id, "stop")]

    def stats(self) -> dict[str, float]:
        return {"tokens": 7, "accesses": 10, "hits": 6, "misses": 4, "hit_rate": 0.6, "evictions": 2,
                "prefetches": 3, "prefetch_precision": 1.0, "prefetch_recall": 0.5, "bytes_read": 2**20,
                "stall_s": 0.25}


def test_help_stats_and_an_empty_answer_said_so() -> None:
    session = ChatSession(StubBackend(), system=None, params=SamplingParams(max_tokens=4, temperature=0.0))
    lines = ["/help", "/stats", "hello"]
    text = typed(session, lines)
    assert "unknown command" not in text and text.count("/stats (expert-cache statistics)") == 2
    assert "hits 6, misses 4 (hit rate 0.60)" in text and "prefetches 3" in text
    assert "(empty answer" in text


def test_stats_before_any_answer_says_so() -> None:
    class Fresh(StubBackend):
        def stats(self) -> dict[str, float]:
            return {**super().stats(), "tokens": 0, "accesses": 0, "hits": 0, "misses": 0}

    session = ChatSession(Fresh(), system=None, params=SamplingParams(max_tokens=4, temperature=0.0))
    lines = ["/stats"]
    text = typed(session, lines)
    assert "no answer yet" in text and "0.0 tokens/s" not in text


def test_dropping_the_oldest_turns_for_the_context_is_said() -> None:
    """A conversation longer than the context loses its oldest messages; the user is told how many."""
    class Short(StubBackend):
        def __init__(self) -> None:
            super().__init__()
            self.context_length = 120

    session = ChatSession(Short(), system=None, params=SamplingParams(max_tokens=4, temperature=0.0))
    text = typed(session, ["a" * 40, "b" * 40, "c" * 40])
    assert "left the conversation to fit the model's context of 120 tokens" in text
    assert [m["content"] for m in session.messages if m["role"] == "user"][-1] == "c" * 40
    assert all("a" * 40 != m["content"] for m in session.messages)  # the first message is gone
    assert "the 2 oldest messages left" in text  # a whole turn: the question and its answer
    assert session.messages[0]["role"] == "user"  # never an answer without its question first
