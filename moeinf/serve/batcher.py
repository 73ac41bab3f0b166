"""Request batching: the paper's setting, one dedicated model thread.

Requests wait in a bounded queue. The model thread takes the first waiting request and gathers more
until it holds `max_batch` sequences or the first one has waited `max_wait_s`, then decodes that batch
step by step (`Backend.generate`) until every sequence has finished; requests arriving meanwhile wait
for the next batch. A full queue refuses new requests (`QueueFullError`, HTTP 429) instead of growing.

Each sequence streams its text as it is generated through its handle's sink, a callable invoked on
the model thread; `AsyncRequest` bridges it to an asyncio queue with `loop.call_soon_threadsafe`, so
blocking model work never runs in the event loop. A cancelled handle (a client that disconnected)
is dropped from its batch at the next step, freeing its row.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from .backend import Backend, SamplingParams
from .metrics import ServerMetrics
from .text import IncrementalText

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is full; the client should retry later (HTTP 429)."""


@dataclass(frozen=True)
class Event:
    """A piece of one sequence's output. The last event has `finish_reason` ("stop", "length",
    "cancelled") or `error` set."""

    text: str
    finish_reason: str | None = None
    error: str | None = None


class RequestHandle:
    """One submitted sequence: its inputs, its timings (monotonic seconds) and its cancellation flag."""

    def __init__(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        stop: Sequence[str],
        sink: Callable[[Event], None],
    ):
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.stop = tuple(stop)
        self.sink = sink
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class AsyncRequest:
    """Async view of a `RequestHandle`: iterate `events()` in the event loop; `cancel()` on disconnect."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self.handle: RequestHandle | None = None

    def sink(self, event: Event) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def events(self) -> AsyncIterator[Event]:
        while True:
            event = await self._queue.get()
            yield event
            if event.finish_reason or event.error:
                return

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()


class Batcher:
    """Gathers requests into batches and runs them on one model thread (see the module docstring)."""

    def __init__(
        self,
        backend: Backend,
        *,
        max_batch: int = 16,
        max_wait_s: float = 1.0,
        max_queue: int = 64,
        metrics: ServerMetrics | None = None,
    ):
        if max_batch < 1 or max_queue < 1 or max_wait_s < 0:
            raise ValueError(
                "max_batch and max_queue must be >= 1 and max_wait_s >= 0 "
                "(--max-batch, --max-queue, --max-wait-s)"
            )
        self.backend = backend
        self.max_batch, self.max_wait_s = max_batch, max_wait_s
        self.metrics = metrics
        self._queue: queue.Queue[RequestHandle] = queue.Queue(maxsize=max_queue)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="moeinf-batcher", daemon=True)
        self.running = 0

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking batches, finish the running one, and fail requests still waiting."""
        self._closing.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        while True:
            try:
                handle = self._queue.get_nowait()
            except queue.Empty:
                break
            handle.sink(Event("", error="the server is shutting down"))

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        stop: Sequence[str],
        sink: Callable[[Event], None],
    ) -> RequestHandle:
        """Queue one sequence; raises `QueueFullError` when `max_queue` requests already wait."""
        if self._closing.is_set():
            raise QueueFullError("the server is shutting down")
        handle = RequestHandle(prompt_ids, params, stop, sink)
        try:
            self._queue.put_nowait(handle)
        except queue.Full:
            raise QueueFullError(
                f"{self._queue.maxsize} requests are already waiting; retry later (or raise --max-queue)"
            ) from None
        self._publish_load()
        return handle

    def submit_async(
        self, prompt_ids: Sequence[int], params: SamplingParams, stop: Sequence[str] = ()
    ) -> AsyncRequest:
        """`submit` from inside a running event loop."""
        request = AsyncRequest(asyncio.get_running_loop())
        request.handle = self.submit(prompt_ids, params, stop, request.sink)
        return request

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def _publish_load(self) -> None:
        if self.metrics:
            self.metrics.set_load(self._queue.qsize(), self.running)

    def _loop(self) -> None:
        while not self._closing.is_set():
            batch = self._collect()
            if batch:
                self.running = len(batch)
                self._publish_load()
                self._run(batch)
                self.running = 0
                self._publish_load()

    def _collect(self) -> list[RequestHandle]:
        try:
            first = self._queue.get(timeout=0.1)
        except queue.Empty:
            return []
        batch = [first]
        deadline = first.arrival + self.max_wait_s
        while len(batch) < self.max_batch:
            remaining = deadline - time.monotonic()
            try:
                batch.append(
                    self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
                )
            except queue.Empty:
                break
        live = []
        for handle in batch:
            if handle.cancelled:
                self._finish(handle, "cancelled", time.monotonic())
            else:
                live.append(handle)
        return live

    def _finish(self, handle: RequestHandle, reason: str, now: float, text: str = "") -> None:
        handle.finish_reason, handle.finished_at = reason, now
        handle.sink(Event(text, finish_reason=reason))
        if self.metrics and reason != "cancelled":
            ttft = handle.first_token_at - handle.arrival if handle.first_token_at is not None else None
            tpot = (
                (now - handle.first_token_at) / (handle.completion_tokens - 1)
                if handle.first_token_at is not None and handle.completion_tokens > 1
                else None
            )
            self.metrics.observe_finished(
                len(handle.prompt_ids), handle.completion_tokens, ttft, tpot, now - handle.arrival
            )

    def _run(self, batch: list[RequestHandle]) -> None:
        texts = [IncrementalText(self.backend.tokenizer, h.prompt_ids, h.stop) for h in batch]
        done: set[int] = set()
        try:
            for step in self.backend.generate([h.prompt_ids for h in batch], [h.params for h in batch], done):
                now = time.monotonic()
                for token in step:
                    i, handle = token.index, batch[token.index]
                    if handle.cancelled:
                        continue
                    handle.completion_tokens += 1
                    if handle.first_token_at is None:
                        handle.first_token_at = now
                    delta = texts[i].push(token.token_id, final=token.finish_reason is not None)
                    reason = "stop" if texts[i].stopped else token.finish_reason
                    if reason:
                        done.add(i)
                        self._finish(handle, reason, now, delta)
                    else:
                        # One event per token, even when its text is held back: streaming clients
                        # see every token arrive (a replay measures TTFT from the first chunk).
                        handle.sink(Event(delta))
                for i, handle in enumerate(batch):
                    if handle.cancelled and i not in done:
                        done.add(i)
                        self._finish(handle, "cancelled", now)
        except Exception as exc:  # a failed batch fails its requests; the server keeps serving
            log.exception("batch of %d sequences failed", len(batch))
            for i, handle in enumerate(batch):
                if i not in done and handle.finish_reason is None:
                    handle.finish_reason = "error"
                    handle.sink(Event("", error=f"generation failed: {exc}"))
