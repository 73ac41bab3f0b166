"""The OpenAI-compatible HTTP server: `create_app(backend, ...)` builds the FastAPI application.

Endpoints: GET / (the chat page, `moeinf/serve/static/chat.html`), GET /v1/models (and /v1/models/ID), POST
/v1/completions, POST /v1/chat/completions (streamed as server-sent events or not), GET /health,
GET /metrics (Prometheus text). Handlers only validate, tokenise and await events: generation runs
on the batcher's model thread. With `api_key` set, every endpoint but / and /health requires
`Authorization: Bearer <key>` (401 otherwise; the page asks for the key).

Safe to run on a user's machine: POST bodies must be JSON (`Content-Type: application/json`), which a
web page of another origin cannot send without a CORS preflight, and no CORS header is sent unless
`cors_origins` names origins; with `allowed_hosts`, a request whose `Host` (or `Origin`) names another
host is refused (403), which defeats DNS rebinding. Bodies over `max_body_bytes` (413) and prompts over
`max_prompt_chars` characters are refused before they are parsed or tokenised.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse

from .backend import Backend
from .batcher import (
    JOIN_HOLD_TOKENS,
    JOIN_MIN_ROWS,
    JOIN_WAIT_S,
    PREFILL_PADDING,
    AsyncRequest,
    Batcher,
    QueueFullError,
    ShuttingDownError,
)
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    MAX_BODY_BYTES,
    PROMPT_CHARS_PER_TOKEN,
    APIError,
    ParsedRequest,
    completion_body,
    new_id,
    parse_json,
    parse_request,
    sampling_params,
    usage,
)
from .text import encode_chat, encode_text

log = logging.getLogger(__name__)


JSON_TYPES = ("application/json",)


def host_name(value: str) -> str:
    """The host of a `Host` header or of an origin URL, lower-case, without port or IPv6 brackets."""
    value = value.strip().lower()
    if "://" in value:
        value = value.split("://", 1)[1].split("/", 1)[0]
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _error_response(err: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def create_app(
    backend: Backend,
    *,
    max_batch: int | None = None,
    max_wait_s: float = 1.0,
    max_queue: int = 64,
    api_key: str | None = None,
    default_max_tokens: int = 256,
    batching: str = "continuous",
    join_wait_s: float = JOIN_WAIT_S,
    join_hold_tokens: int = JOIN_HOLD_TOKENS,
    join_min_rows: int = JOIN_MIN_ROWS,
    prefill_padding: float = PREFILL_PADDING,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_prompt_chars: int | None = None,
    allowed_hosts: Sequence[str] | None = None,
    cors_origins: Sequence[str] = (),
    trim_idle: bool = True,
) -> FastAPI:
    """The server application over `backend`; its batcher thread runs for the app's lifespan.

    `max_prompt_chars` defaults to `PROMPT_CHARS_PER_TOKEN` per token of the context window;
    `allowed_hosts` None accepts any `Host` (the serve command passes the bound address's names);
    `cors_origins` are the web origins allowed to call the API from a browser ("*" any)."""
    if max_body_bytes < 1:
        raise ValueError("max_body_bytes must be >= 1 (--max-body-bytes)")
    if max_prompt_chars is None:
        max_prompt_chars = PROMPT_CHARS_PER_TOKEN * backend.context_length
    if max_prompt_chars < 1:
        raise ValueError("max_prompt_chars must be >= 1 (--max-prompt-chars)")
    hosts = None if allowed_hosts is None or "*" in allowed_hosts else {host_name(h) for h in allowed_hosts}
    origins = {o.rstrip("/").lower() for o in cors_origins}
    metrics = ServerMetrics(backend.stats)
    batcher = Batcher(
        backend,
        max_batch=max_batch,
        max_wait_s=max_wait_s,
        max_queue=max_queue,
        metrics=metrics,
        batching=batching,
        join_wait_s=join_wait_s,
        join_hold_tokens=join_hold_tokens,
        join_min_rows=join_min_rows,
        prefill_padding=prefill_padding,
        trim_idle=trim_idle,
    )
    page = resources.files("moeinf.serve").joinpath("static/chat.html").read_text(encoding="utf-8")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        try:
            yield
        finally:
            batcher.close()

    async def authenticate(request: Request) -> None:
        # A dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware hides client disconnects.
        if hosts is not None:
            host = host_name(request.headers.get("host", ""))
            if host not in hosts:
                raise APIError(403, f"the Host header {host!r} is not an address of this server; add it with "
                                    "--allow-host", type="permission_error", code="host_not_allowed")
            origin = request.headers.get("origin")
            if origin and origin.rstrip("/").lower() not in origins and "*" not in origins and (
                host_name(origin) not in hosts
            ):
                raise APIError(403, f"requests from the web origin {origin!r} are not allowed; allow it with "
                                    "--cors-origin", type="permission_error", code="origin_not_allowed")
        if api_key and request.url.path not in ("/", "/health"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                raise APIError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    type="authentication_error",
                    code="invalid_api_key",
                )

    app = FastAPI(
        title="moeinf",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        dependencies=[Depends(authenticate)],
    )
    app.state.backend, app.state.batcher, app.state.metrics = backend, batcher, metrics
    if origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=sorted(origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return _error_response(
            APIError(404, f"no route {request.method} {request.url.path}", code="not_found")
        )

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc: Exception) -> JSONResponse:
        return _error_response(APIError(405, f"{request.method} is not allowed on {request.url.path}"))

    @app.get("/")
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": backend.name,
            "queue_depth": batcher.queue_depth,
            "running": batcher.running,
            "batching": batcher.batching,
        }

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)

    def unknown_model(name: str) -> APIError:
        return APIError(404, f"model {name!r} does not exist; this server serves {backend.name!r}",
                        param="model", code="model_not_found")

    card = {"id": backend.name, "object": "model", "created": 0, "owned_by": "moeinf",
            "max_model_len": backend.context_length}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")  # OpenAI's "retrieve model" (client.models.retrieve)
    async def model(name: str) -> Response:
        if name != backend.name:
            return _error_response(unknown_model(name))
        return JSONResponse(card)

    async def handle(request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            body = parse_json(await _read_body(request, max_body_bytes))
            req = parse_request(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
            if req.model != backend.name:
                raise unknown_model(req.model)
            _check_prompt_chars(req, max_prompt_chars)
            prompt_ids = _prompt_ids(backend, req)
            params = sampling_params(req, len(prompt_ids), backend.context_length, default_max_tokens)
            try:
                pending = batcher.submit_async(prompt_ids, params, req.stop)
            except QueueFullError as exc:
                raise APIError(429, str(exc), type="rate_limit_error", code="queue_full") from None
            except ShuttingDownError as exc:
                raise APIError(503, str(exc), type="server_error", code="shutting_down") from None
        except APIError as err:
            metrics.count_request(endpoint, str(err.status))
            return _error_response(err)
        reply = _Reply(pending, new_id("chatcmpl" if chat else "cmpl"), req, len(prompt_ids), chat, metrics,
                       endpoint)
        if req.stream:
            return StreamingResponse(
                _stream(reply),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        watcher = asyncio.create_task(_cancel_on_disconnect(request, pending))
        try:
            return await _complete(reply)
        finally:
            watcher.cancel()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The body of a JSON POST, refused (415, 413) before it is read when its type or declared length is
    wrong, and as soon as it passes `limit` bytes when it is sent without a length."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind not in JSON_TYPES:
        raise APIError(415, f"the body must be JSON sent as 'Content-Type: application/json', not "
                            f"{kind or 'no content type'!r}", code="unsupported_media_type")
    too_big = APIError(413, f"the request body is larger than {limit} bytes; send a shorter prompt (or raise "
                            "--max-body-bytes)", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _check_prompt_chars(req: ParsedRequest, limit: int) -> None:
    """Refuse a prompt longer than `limit` characters before the tokenizer sees it."""
    if req.messages is not None:
        chars, param = sum(len(m["content"]) for m in req.messages), "messages"
    elif isinstance(req.prompt, str):
        chars, param = len(req.prompt), "prompt"
    else:
        chars, param = len(req.prompt or ()), "prompt"
    if chars > limit:
        raise APIError(400, f"the prompt has {chars} characters, more than the {limit} this server accepts "
                            "(--max-prompt-chars); shorten it", param=param, code="context_length_exceeded")


def _prompt_ids(backend: Backend, req: ParsedRequest) -> list[int]:
    if req.messages is not None:
        return encode_chat(backend.tokenizer, req.messages)
    if isinstance(req.prompt, list):
        if max(req.prompt) >= backend.vocab_size:
            raise APIError(400, f"token id {max(req.prompt)} is outside the vocabulary", param="prompt")
        return list(req.prompt)
    ids = encode_text(backend.tokenizer, req.prompt or "")
    if not ids:
        raise APIError(400, "the prompt encodes to no tokens", param="prompt")
    return ids


async def _cancel_on_disconnect(request: Request, pending: AsyncRequest) -> None:
    """A non-streamed request whose client went away stops generating (its batch row is freed)."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)
    pending.cancel()


@dataclass(frozen=True)
class _Reply:
    """What answering one submitted request needs, streamed (`_stream`) or whole (`_complete`)."""

    pending: AsyncRequest
    rid: str
    req: ParsedRequest
    prompt_tokens: int
    chat: bool
    metrics: ServerMetrics
    endpoint: str


async def _complete(reply: _Reply) -> Response:
    pending, rid, req, chat = reply.pending, reply.rid, reply.req, reply.chat
    metrics, endpoint, prompt_tokens = reply.metrics, reply.endpoint, reply.prompt_tokens
    parts: list[str] = []
    finish: str | None = None
    try:
        async for event in pending.events():
            if event.error:
                metrics.count_request(endpoint, str(event.status))
                return _error_response(APIError(event.status, event.error, type="server_error"))
            parts.append(event.text)
            finish = event.finish_reason
    finally:
        pending.cancel()
    if finish == "cancelled":
        metrics.count_request(endpoint, "cancelled")
        return _error_response(APIError(499, "the client disconnected", code="client_closed_request"))
    handle = pending.handle
    assert handle is not None
    metrics.count_request(endpoint, "200")
    return JSONResponse(
        completion_body(
            rid,
            req.model,
            "".join(parts),
            finish,
            usage(prompt_tokens, handle.completion_tokens),
            chat=chat,
            chunk=False,
        )
    )


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


async def _stream(reply: _Reply) -> AsyncIterator[str]:
    pending, rid, req, chat = reply.pending, reply.rid, reply.req, reply.chat
    metrics, endpoint, prompt_tokens = reply.metrics, reply.endpoint, reply.prompt_tokens
    outcome = "cancelled"
    try:
        if chat:
            yield _sse(completion_body(rid, req.model, "", None, None, chat=True, chunk=True, first=True))
        async for event in pending.events():
            if event.error:
                outcome = str(event.status)
                yield _sse(APIError(event.status, event.error, type="server_error").body())
                break
            yield _sse(
                completion_body(rid, req.model, event.text, event.finish_reason, None, chat=chat, chunk=True)
            )
            if event.finish_reason:
                outcome = "200"
        if outcome == "200" and req.include_usage and pending.handle is not None:
            body = completion_body(
                rid,
                req.model,
                "",
                None,
                usage(prompt_tokens, pending.handle.completion_tokens),
                chat=chat,
                chunk=True,
            )
            body["choices"] = []
            yield _sse(body)
        yield "data: [DONE]\n\n"
    finally:
        # Runs when the client disconnects too (the response task is cancelled): drop the sequence.
        pending.cancel()
        metrics.count_request(endpoint, outcome)
        log.debug("request %s ended (%s) at %.3f", rid, outcome, time.monotonic())


class _Server(uvicorn.Server):
    """uvicorn's server, ending every open request when asked to stop (Ctrl-C, SIGTERM): uvicorn waits
    for open responses before it shuts the app down, and a stream ends only when its sequence does, so
    the batcher is aborted first and each stream closes with an error event."""

    def __init__(self, config: uvicorn.Config, batcher: Batcher):
        super().__init__(config)
        self.batcher = batcher

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.batcher.abort()
        super().handle_exit(sig, frame)


def make_server(app: FastAPI, *, graceful_s: float = 5.0, log_level: str = "info") -> uvicorn.Server:
    """A uvicorn server of `app` (from `create_app`) whose Ctrl-C or SIGTERM ends open requests first."""
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=graceful_s)
    return _Server(config, app.state.batcher)


def run_server(app: FastAPI, sock: socket.socket) -> None:
    """Serve `app` on the bound, listening `sock` until Ctrl-C or SIGTERM."""
    make_server(app).run(sockets=[sock])
