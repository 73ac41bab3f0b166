"""Send a workload at its arrival times and time every request.

In-process, requests go through the server's own `Batcher` (the same batching and model thread as
`moeinf serve`); against a running server (`url`), through its /v1/completions streaming endpoint
with the prompt as token ids. Times are measured from each request's scheduled arrival, so time
spent waiting for a batch counts, as it does for a real client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from moeinf.serve.backend import Backend, SamplingParams
from moeinf.serve.batcher import (
    JOIN_HOLD_TOKENS,
    JOIN_MIN_ROWS,
    JOIN_WAIT_S,
    PREFILL_PADDING,
    Batcher,
    QueueFullError,
)

from .workload import WorkItem

log = logging.getLogger(__name__)


@dataclass
class RequestResult:
    """Timings of one replayed request (seconds; None when the request failed)."""

    policy: str
    index: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    per_token_s: float | None = None
    """End-to-end latency divided by output tokens: the paper's per-token latency (the SLO metric)."""
    error: str = ""

    def finish(self, ttft_s: float | None, e2e_s: float, output_tokens: int) -> None:
        self.output_tokens, self.ttft_s, self.e2e_s = output_tokens, ttft_s, e2e_s
        if output_tokens:
            self.per_token_s = e2e_s / output_tokens
        if ttft_s is not None and output_tokens > 1:
            self.tpot_s = (e2e_s - ttft_s) / (output_tokens - 1)

    def row(self) -> dict[str, object]:
        return asdict(self)


Progress = Callable[[RequestResult], None]


def _params(item: WorkItem) -> SamplingParams:
    # Greedy and exactly the trace's output length: the latency of a request must not depend on luck.
    return SamplingParams(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True)


async def _one_local(
    batcher: Batcher, item: WorkItem, t0: float, result: RequestResult, progress: Progress | None
) -> None:
    await asyncio.sleep(max(0.0, t0 + item.arrival_s - time.monotonic()))
    arrival = t0 + item.arrival_s
    try:
        pending = batcher.submit_async(item.prompt_ids, _params(item))
    except QueueFullError as exc:
        result.error = f"rejected: {exc}"
    else:
        async for event in pending.events():
            if event.error:
                result.error = event.error
        handle = pending.handle
        assert handle is not None
        if not result.error and handle.finished_at is not None:
            ttft = handle.first_token_at - arrival if handle.first_token_at is not None else None
            result.finish(ttft, handle.finished_at - arrival, handle.completion_tokens)
    if progress:
        progress(result)


def warm_up(backend: Backend, items: Sequence[WorkItem]) -> None:
    """One short untimed batch, so the first policy does not pay for lazy initialisation."""
    prompt = items[0].prompt_ids[:16]
    for _ in backend.generate([prompt], [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)]):
        pass


async def _replay_local(
    backend: Backend,
    items: Sequence[WorkItem],
    policy: str,
    scheduler: dict[str, Any],
    progress: Progress | None,
) -> list[RequestResult]:
    batcher = Batcher(backend, max_queue=len(items) + 1, **scheduler)
    batcher.start()
    try:
        results = [
            RequestResult(policy, it.index, it.arrival_s, len(it.prompt_ids), it.max_tokens) for it in items
        ]
        t0 = time.monotonic()
        await asyncio.gather(
            *(_one_local(batcher, it, t0, r, progress) for it, r in zip(items, results, strict=True))
        )
        return results
    finally:
        await asyncio.to_thread(batcher.close)


def replay_local(
    backend: Backend,
    items: Sequence[WorkItem],
    *,
    policy: str,
    max_batch: int | None = None,
    max_wait_s: float = 1.0,
    join_wait_s: float = JOIN_WAIT_S,
    join_hold_tokens: int = JOIN_HOLD_TOKENS,
    join_min_rows: int = JOIN_MIN_ROWS,
    prefill_padding: float = PREFILL_PADDING,
    batching: str = "continuous",
    progress: Progress | None = None,
) -> list[RequestResult]:
    """Replay `items` on an in-process backend with the server's scheduler (`Batcher`, whose knobs the
    keyword arguments are; after an untimed warm-up)."""
    scheduler: dict[str, Any] = {
        "max_batch": max_batch,
        "max_wait_s": max_wait_s,
        "join_wait_s": join_wait_s,
        "join_hold_tokens": join_hold_tokens,
        "join_min_rows": join_min_rows,
        "prefill_padding": prefill_padding,
        "batching": batching,
    }
    warm_up(backend, items)
    return asyncio.run(_replay_local(backend, items, policy, scheduler, progress))


class ServerError(RuntimeError):
    """The --url server cannot be replayed against (unreachable, wrong key, another model)."""


def check_server(url: str, model: str, api_key: str | None) -> None:
    """Raise `ServerError`, in one line, for a server that is not there, refuses the key or serves
    another model."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise ServerError(f"cannot reach {url} ({exc}); is `moeinf serve` running there? (--url)") from None
    if r.status_code == 401:
        raise ServerError(f"{url} refused the API key (HTTP 401); give the server's key with --api-key")
    if r.status_code != 200:
        raise ServerError(
            f"{url}/v1/models answered HTTP {r.status_code}; is it an OpenAI-compatible server?"
        )
    served = [m.get("id") for m in r.json().get("data", [])]
    if model not in served:
        raise ServerError(f"{url} serves {served}, not {model!r}; pass --model-name")


async def _one_remote(
    client, url: str, model: str, item: WorkItem, t0: float, result: RequestResult, progress: Progress | None
) -> None:
    await asyncio.sleep(max(0.0, t0 + item.arrival_s - time.monotonic()))
    arrival = t0 + item.arrival_s
    body = {
        "model": model,
        "prompt": item.prompt_ids,
        "max_tokens": item.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first: float | None = None
    tokens = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        result.error = chunk["error"].get("message", "server error")
                    elif chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    elif first is None and chunk["choices"]:  # one chunk per token
                        first = time.monotonic()
    except Exception as exc:  # a failed request is recorded, the replay goes on
        result.error = f"{type(exc).__name__}: {exc}"
    if not result.error:
        result.finish(first - arrival if first is not None else None, time.monotonic() - arrival, tokens)
    if progress:
        progress(result)


async def _replay_remote(
    url: str,
    items: Sequence[WorkItem],
    model: str,
    api_key: str | None,
    policy: str,
    progress: Progress | None,
) -> list[RequestResult]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(items) + 1)
    async with httpx.AsyncClient(headers=headers, timeout=None, limits=limits) as client:
        results = [
            RequestResult(policy, it.index, it.arrival_s, len(it.prompt_ids), it.max_tokens) for it in items
        ]
        t0 = time.monotonic()
        await asyncio.gather(
            *(
                _one_remote(client, url, model, it, t0, r, progress)
                for it, r in zip(items, results, strict=True)
            )
        )
    return results


def replay_remote(
    url: str,
    items: Sequence[WorkItem],
    *,
    model: str,
    api_key: str | None = None,
    policy: str = "server",
    progress: Progress | None = None,
) -> list[RequestResult]:
    """Replay `items` against a running `moeinf serve` (any OpenAI-compatible server accepting token-id
    prompts and `ignore_eos`)."""
    return asyncio.run(_replay_remote(url.rstrip("/"), items, model, api_key, policy, progress))
