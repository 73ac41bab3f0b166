"""The OpenAI wire format: request validation, errors, response and stream-chunk bodies.

Validation is explicit rather than a schema library's, so that every bad input becomes an OpenAI-style
error `{"error": {"message", "type", "param", "code"}}` with a 4xx status and a message that says what
to change. Fields the server does not implement are rejected, never silently ignored.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from .backend import SamplingParams
from .running import SEED_RANGE

MAX_BODY_BYTES = 4 * 2**20
"""Default cap on a request body (`create_app(max_body_bytes=)`, `moeinf serve --max-body-bytes`)."""
PROMPT_CHARS_PER_TOKEN = 32
"""Default prompt cap in characters: this many per token of the context window (a token of ordinary
text is 3-5 characters), so no prompt that could fit is refused and a far too long one is never
tokenised."""
MAX_JSON_DEPTH = 32
"""Deepest nesting of objects and arrays a request body may have (the deepest valid request is 4)."""
MAX_NUMBER_CHARS = 64
"""Longest number literal a request body may hold (a 64-bit seed has 20 digits)."""
MAX_TOKENS_LIMIT = 2**31 - 1
"""Largest `max_tokens` looked at (the context window refuses most below it anyway)."""


class APIError(Exception):
    """An error returned to the client as OpenAI-style JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Accepted but without effect on a single greedy/sampled choice; anything else unknown is a 400.
_NEUTRAL = {
    "user",
    "stream_options",
    "logprobs",
    "echo",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "best_of",
    "suffix",
    "top_logprobs",
    "service_tier",
    "store",
    "metadata",
    "parallel_tool_calls",
    "max_completion_tokens",
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "stream", "ignore_eos"}
COMPLETION_FIELDS = _COMMON | {"prompt"}
CHAT_FIELDS = _COMMON | {"messages", "response_format", "tools", "tool_choice", "functions", "function_call"}
"""`response_format`, `tools` and `tool_choice` (and their older spellings `functions` and `function_call`)
are taken at the values that ask for plain text (what clients send by default); any other value is
refused by name (`_check_defaults`)."""


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request: what to generate (prompt tokens are filled in by the app)."""

    model: str
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    max_tokens: int | None
    sampling: dict[str, Any]
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise APIError(400, f"a number in the body has {len(text)} characters; at most {MAX_NUMBER_CHARS} "
                            "are accepted")
    return int(text)


def _float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise APIError(400, f"a number in the body has {len(text)} characters; at most {MAX_NUMBER_CHARS} "
                            "are accepted")
    value = float(text)
    if not math.isfinite(value):
        raise APIError(400, f"the number {text[:20]} is out of range (it is not a finite double)")
    return value


def _constant(text: str) -> float:
    raise APIError(400, f"{text} is not valid JSON (numbers must be finite)")


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (iterative: any depth of input is safe)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            if depth > MAX_JSON_DEPTH:
                break
            stack.extend((child, depth + 1) for child in item if isinstance(child, (dict, list)))
    return deepest


def parse_json(raw: bytes) -> Any:
    """The JSON value of a request body, or a 400 APIError: not UTF-8 or not JSON, a number longer than
    `MAX_NUMBER_CHARS`, a non-finite number, or nesting deeper than `MAX_JSON_DEPTH`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not UTF-8: {exc}") from None
    try:
        value = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except RecursionError:
        raise APIError(400, f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)"
                       ) from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except ValueError as exc:  # a number the parser refuses
        raise APIError(400, f"the request body holds an unreadable number: {exc}") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise APIError(400, f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)")
    return value


def _text(value: str, param: str) -> str:
    """`value` if it is valid Unicode text (lone surrogates such as "\\ud800" are not)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"'{param}' holds an invalid character ({exc.reason} at {exc.start}); "
                            "send valid UTF-8 text", param=param) from None
    return value


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not lo <= value <= hi):
        raise APIError(400, f"'{name}' must be a number in [{lo}, {hi}], got {value!r}", param=name)
    return float(value)


def _check_defaults(body: dict) -> None:
    """Reject neutral fields set to values this server cannot honour."""
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise APIError(400, f"'{name}' is not supported; omit it or set it to 0", param=name)
    for name in ("logprobs", "top_logprobs", "logit_bias", "suffix", "echo"):
        if body.get(name) not in (None, False, {}, 0):
            raise APIError(400, f"'{name}' is not supported by this server; omit it", param=name)
    if body.get("response_format") not in (None, {"type": "text"}):
        raise APIError(400, "'response_format' other than {\"type\": \"text\"} is not supported: this server "
                            "returns plain text; omit it", param="response_format")
    asked = [name for name, plain in (("tools", (None, [])), ("tool_choice", (None, "none")),
                                      ("functions", (None, [])), ("function_call", (None, "none")))
             if body.get(name) not in plain]
    if asked:
        raise APIError(400, f"'{asked[0]}' is not supported: this server does not call tools; omit it",
                       param=asked[0])
    if body.get("best_of") not in (None, 1):
        raise APIError(400, "'best_of' must be 1 (one choice per request)", param="best_of")


_MESSAGE_SHAPE = ('each message must be {"role": system|developer|user|assistant, '
                  '"content": string or text parts}')


def _message(m: Any) -> dict[str, str]:
    """One chat message, its content as one string: a string, or a list of text parts
    ([{"type": "text", "text": ...}], as OpenAI's clients may send; the texts joined by newlines)."""
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
        raise APIError(400, _MESSAGE_SHAPE, param="messages")
    content = m.get("content")
    if isinstance(content, list) and content:
        for part in content:
            text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            if not isinstance(text, str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(400, 'only text content parts ({"type": "text", "text": string}) are served '
                                    f"here, got {kind!r}", param="messages")
        content = "\n".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise APIError(400, _MESSAGE_SHAPE, param="messages")
    _text(content, "messages")
    return {**m, "content": content}


def parse_request(body: Any, fields: set[str]) -> ParsedRequest:
    """Validate the JSON body of /v1/completions (`COMPLETION_FIELDS`) or /v1/chat/completions."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - fields - _NEUTRAL)
    if unknown:
        raise APIError(400, f"unsupported field(s) {unknown}", param=unknown[0])
    _check_defaults(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required: the name listed by GET /v1/models", param="model")
    if body.get("n") not in (None, 1):
        raise APIError(400, "'n' must be 1: this server returns one choice per request", param="n")

    prompt = messages = None
    if "prompt" in fields:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        token_list = (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
        )
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise APIError(400, f"'prompt' holds {len(prompt)} prompts; this server answers one prompt per "
                                "request: send them as separate requests (they are batched together)",
                           param="prompt")
        if not (isinstance(prompt, str) and prompt) and not token_list:
            raise APIError(
                400,
                "'prompt' is required: a non-empty string or a list of token ids (one prompt per request)",
                param="prompt",
            )
        if isinstance(prompt, str):
            _text(prompt, "prompt")
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(
                400, "'messages' is required: a non-empty list of {role, content}", param="messages"
            )
        messages = [_message(m) for m in messages]

    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is not None and (
        isinstance(max_tokens, bool)
        or not isinstance(max_tokens, int)
        or not 1 <= max_tokens <= MAX_TOKENS_LIMIT
    ):
        raise APIError(
            400,
            f"'max_tokens' must be an integer in [1, {MAX_TOKENS_LIMIT}], got {max_tokens!r}",
            param="max_tokens",
        )
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise APIError(400, "'stop' must be a string or a list of up to 4 strings", param="stop")
    if any(not s for s in stops):
        raise APIError(400, "'stop' strings must not be empty", param="stop")
    for s in stops:
        _text(s, "stop")
    seed = body.get("seed")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]
    ):
        raise APIError(
            400, f"'seed' must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {seed!r}",
            param="seed",
        )
    stream = body.get("stream", False)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(stream, bool) or not isinstance(ignore_eos, bool):
        raise APIError(400, "'stream' and 'ignore_eos' must be booleans")
    options = body.get("stream_options") or {}
    sampling = dict(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        seed=seed,
        ignore_eos=ignore_eos,
    )
    if sampling["top_p"] == 0.0:
        raise APIError(400, "'top_p' must be > 0", param="top_p")
    return ParsedRequest(
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stops,
        stream=stream,
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
    )


def sampling_params(
    req: ParsedRequest, prompt_len: int, context_length: int, default_max_tokens: int
) -> SamplingParams:
    """Check the lengths against the context window and build the backend's SamplingParams."""
    room = context_length - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"the prompt has {prompt_len} tokens but the model's context window is "
            f"{context_length}; shorten the prompt",
            param="messages" if req.messages else "prompt",
            code="context_length_exceeded",
        )
    max_tokens = req.max_tokens if req.max_tokens is not None else min(default_max_tokens, room)
    if max_tokens > room:
        raise APIError(
            400,
            f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceed the "
            f"context window of {context_length}; ask for at most {room} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return SamplingParams(max_tokens=max_tokens, **req.sampling)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    rid: str,
    model: str,
    text: str,
    finish: str | None,
    usage_: dict | None,
    *,
    chat: bool,
    chunk: bool,
    first: bool = False,
) -> dict[str, Any]:
    """A response (`chunk=False`) or one stream chunk of a completion or chat completion."""
    if chat:
        if chunk:
            delta: dict[str, str] = {"role": "assistant", "content": text} if first else {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    body: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body
