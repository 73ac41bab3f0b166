"""Request scheduling on one dedicated model thread: continuous (iteration-level) or static batching.

Requests wait in a bounded queue; a full queue refuses new requests (`QueueFullError`, HTTP 429)
instead of growing.

- continuous (default): before every decode step the model thread admits the waiting requests (up to
  `max_batch` running rows), prefills them (shortest prompts first, in passes of similar lengths:
  `prefill_groups`) and lets them join the running batch; a finished or cancelled row leaves at once
  (`moeinf.serve.running.RunningBatch`).
- static (the MoE-Infinity paper's setting): the thread takes the first waiting request and gathers
  more until it holds `max_batch` sequences or the first one has waited `max_wait_s`, then decodes
  that batch until every sequence has finished; requests arriving meanwhile wait for the next batch.

Each sequence streams its text as it is generated through its handle's sink, a callable invoked on
the model thread; `AsyncRequest` bridges it to an asyncio queue with `loop.call_soon_threadsafe`, so
blocking model work never runs in the event loop. A cancelled handle (a client that disconnected)
leaves its batch at the next step, freeing its row. `abort` (server shutdown) ends every open request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass

from .backend import Backend, SamplingParams, StepToken
from .memory import IdleTrimmer
from .metrics import ServerMetrics
from .text import IncrementalText

log = logging.getLogger(__name__)

BATCHING = ("continuous", "static")


class QueueFullError(RuntimeError):
    """The waiting queue is full; the client should retry later (HTTP 429)."""


class ShuttingDownError(RuntimeError):
    """The server is stopping and takes no new request (HTTP 503)."""


SHUTDOWN = "the server is shutting down"


@dataclass(frozen=True)
class Event:
    """A piece of one sequence's output. The last event has `finish_reason` ("stop", "length",
    "cancelled") or `error` set; `status` is the HTTP status an error maps to (503: cut by shutdown)."""

    text: str
    finish_reason: str | None = None
    error: str | None = None
    status: int = 500


MAX_BATCH = {"continuous": 64, "static": 16}
"""Default `max_batch` (rows decoded together) of each scheduler. Static batching decodes a gathered
batch to its end, so a larger batch holds its early finishers idle and makes the next batch wait longer (16,
the MoE-Infinity paper's setting). Continuous batching frees a row as soon as its sequence ends, so it can
run more rows: on the zoo model at 25% a decode step of 16 rows costs ~3.5x one row, so more rows serve more
tokens per second, and in the bursts of the Azure trace (`moeinf replay`; docs/benchmarks.md) 16 rows fill
and requests queue for their first token, while 64 rows let arrivals join at once: the slowest first tokens
come an order of magnitude sooner, with more tokens per second, for a higher time per output token (a 60-row
decode step costs ~2x a 16-row one, ~8x one row). Memory: each row keeps its KV cache as wide as the longest
running row; on the zoo model 2.5 KiB per token, so 64 rows of 454 tokens held 71 MiB (measured); a larger
model needs `--max-batch` sized to its KV cache."""


JOIN_WAIT_S = 0.3
"""Continuous batching: longest a request waits to join running rows beside later arrivals (`_admit`).
Each prefill pass of an offloaded model reads most experts of every layer, so arrivals that share one
pass cost about one arrival's reads. On the zoo model at 25% a 0.3 s hold halves TPOT p50 and raises
throughput at the same request rates, for a TTFT p99 0.1-0.2 s higher."""


PREFILL_PADDING = 1.5
"""Continuous batching: arrivals that join together are prefilled shortest first, in passes whose
padded tokens (rows x longest prompt) are at most this many times their real tokens
(`prefill_groups`; 1.5 lets two prompts share a pass when one is at most 3x the other). Prompts are
left-padded to the longest in a pass, so one pass of a 407-token prompt with three short ones computed
1,628 tokens and gave the short ones their first token only after all of it (the slowest first tokens
of a replay of the Azure trace); a pass of its own costs a short prompt ~60-100 ms on the zoo model at
25%, mostly expert reads, so similar lengths still share one."""


def prefill_groups(lengths: Sequence[int], max_padding: float) -> list[list[int]]:
    """Indices of `lengths` (prompt lengths) in prefill passes: sorted by length, shortest first; a pass
    takes the next prompt while its rows x longest prompt stay within `max_padding` x its real tokens."""
    groups: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[i] <= max_padding * (real + lengths[i]):
            groups[-1].append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


JOIN_HOLD_TOKENS = 128
"""Continuous batching: held arrivals join as soon as their prompts hold this many tokens together
(`Batcher._admit`). The hold exists to share a prefill pass's fixed cost (on the zoo model at 25%, a
pass of one 10-token prompt took 34 ms, one 100-token prompt 61 ms, four 111 ms: quiet machine); a
long prompt cannot share a pass with short ones anyway (`PREFILL_PADDING`), so holding it only delays
it. In an unrecorded 60 s replay at x1 with the prefill grouping alone, the slowest first tokens
outside the trace's final burst were 255- to 409-token prompts held 0.3 s (0.56-0.83 s)."""


JOIN_MIN_ROWS = 8
"""Continuous batching with the batch full and requests queueing: freed rows are refilled once this
many are free (`Batcher._admit`), not one by one. A prefill pass has a fixed cost: on the zoo model at
25%, one 100-token prompt's pass took 61 ms and four's 111 ms, a decode step of 16 rows 39 ms (quiet
machine); when rows were refilled one at a time, a burst of the Azure trace at x2 spent most of its
time in passes of one request each. 8 is an eighth of the 64 rows continuous batching runs
(`MAX_BATCH`)."""


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
        max_batch: int | None = None,
        max_wait_s: float = 1.0,
        max_queue: int = 64,
        metrics: ServerMetrics | None = None,
        batching: str = "continuous",
        join_wait_s: float = JOIN_WAIT_S,
        prefill_padding: float = PREFILL_PADDING,
        join_hold_tokens: int = JOIN_HOLD_TOKENS,
        join_min_rows: int = JOIN_MIN_ROWS,
        trim_idle: bool = True,
    ):
        """`trim_idle`: give the allocator's free memory back to the system when the batcher becomes idle
        after work (`moeinf.serve.memory`)."""
        if batching not in BATCHING:
            raise ValueError(f"batching must be one of {BATCHING}, not {batching!r} (--batching)")
        if max_batch is None:
            max_batch = MAX_BATCH[batching]
        if max_batch < 1 or max_queue < 1 or max_wait_s < 0 or join_wait_s < 0:
            raise ValueError(
                "max_batch and max_queue must be >= 1, max_wait_s and join_wait_s >= 0 "
                "(--max-batch, --max-queue, --max-wait-s, --join-wait-s)"
            )
        if prefill_padding < 1 or join_hold_tokens < 1 or join_min_rows < 1:
            raise ValueError(
                "prefill_padding (padded tokens per real token of a prefill pass), join_hold_tokens and "
                "join_min_rows must be >= 1"
            )
        self.backend = backend
        self.batching = batching
        self.max_batch, self.max_wait_s, self.join_wait_s = max_batch, max_wait_s, join_wait_s
        self.prefill_padding, self.join_hold_tokens = prefill_padding, join_hold_tokens
        self.join_min_rows = join_min_rows
        self._held: list[RequestHandle] = []  # continuous: taken from the queue, waiting to join together
        self.metrics = metrics
        self._queue: queue.Queue[RequestHandle] = queue.Queue(maxsize=max_queue)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="moeinf-batcher", daemon=True)
        self.running = 0
        self.trimmer = IdleTrimmer(trim_idle)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking requests, end the running ones after the current step and fail waiting ones."""
        self.abort()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._fail_waiting()

    def abort(self) -> None:
        """End every open request (server shutdown): running rows finish with an error at the next
        step, so their streams close; waiting requests fail now. Safe from any thread."""
        self._closing.set()
        self._fail_waiting()

    def _fail_waiting(self) -> None:
        while True:
            try:
                handle = self._queue.get_nowait()
            except queue.Empty:
                break
            handle.finish_reason = "error"
            handle.sink(Event("", error=SHUTDOWN, status=503))

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        stop: Sequence[str],
        sink: Callable[[Event], None],
    ) -> RequestHandle:
        """Queue one sequence; raises `QueueFullError` when `max_queue` requests already wait."""
        if self._closing.is_set():
            raise ShuttingDownError(SHUTDOWN)
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
        return self._queue.qsize() + len(self._held)

    def _publish_load(self) -> None:
        if self.metrics:
            self.metrics.set_load(self.queue_depth, self.running)

    def _loop(self) -> None:
        if self.batching == "continuous":
            self._loop_continuous()
            return
        while not self._closing.is_set():
            batch = self._collect()
            if batch:
                self.trimmer.busy()
                self.running = len(batch)
                self._publish_load()
                self._run(batch)
                self.running = 0
                self._publish_load()
            elif self._queue.empty():
                self.trimmer.idle()

    def _loop_continuous(self) -> None:
        batch = self.backend.open_batch()
        running: dict[int, tuple[RequestHandle, IncrementalText]] = {}  # key -> its request
        next_key = 0
        while not self._closing.is_set():
            joining: list[RequestHandle] = []
            try:
                joining = self._admit(len(running), block=not running)
                self.running = len(running) + len(joining)
                self._publish_load()
                # Short prompts first, each group one pass whose first tokens go out at once.
                for group in prefill_groups([len(h.prompt_ids) for h in joining], self.prefill_padding):
                    keys = list(range(next_key, next_key + len(group)))
                    next_key += len(group)
                    handles = [joining[i] for i in group]
                    try:
                        first = batch.join(keys, [h.prompt_ids for h in handles], [h.params for h in handles])
                    except Exception as exc:  # this prefill pass fails its own requests only
                        log.exception("a prefill pass of %d sequences failed", len(handles))
                        self._fail(handles, f"generation failed: {exc}")
                        continue
                    for key, handle in zip(keys, handles, strict=True):
                        running[key] = (
                            handle,
                            IncrementalText(self.backend.tokenizer, handle.prompt_ids, handle.stop),
                        )
                    self._emit(running, first)
                gone = [k for k, (h, _) in running.items() if h.cancelled or h.finish_reason]
                batch.leave(gone)
                now = time.monotonic()
                for key in gone:
                    handle, _ = running.pop(key)
                    if handle.finish_reason is None:
                        self._finish(handle, "cancelled", now)
                if running:
                    self.trimmer.busy()
                    self._emit(running, batch.step())
                elif not joining and not self._held and self._queue.empty():
                    self.trimmer.idle()
            except Exception as exc:  # a failed decode step fails its rows; the server keeps serving
                log.exception("a step of %d sequences failed", len(running))
                failed = [*(handle for handle, _ in running.values()), *joining]
                self._fail(failed, f"generation failed: {exc}")
                running.clear()
                batch.close()
        self._fail([*(handle for handle, _ in running.values()), *self._held], SHUTDOWN, 503)
        self._held.clear()
        batch.close()
        self.running = 0
        self._publish_load()

    def _admit(self, running: int, *, block: bool) -> list[RequestHandle]:
        """Waiting requests that join beside `running` rows now (waits briefly for one when `block`).

        Each join is a prefill pass of its own, which with offloaded experts reads about as many experts
        for one prompt as for several, and stalls the running rows meanwhile. So while rows run, arrivals
        are held until they can fill the batch, the first has waited `join_wait_s`, or they hold
        `join_hold_tokens` prompt tokens together (a pass that long reads nearly every expert anyway, so
        waiting shares nothing more), and then join (`prefill_groups`); with nothing running they join
        at once. When the batch is full and requests queue, rows that free up wait until
        `join_min_rows` are free, so that a burst joins a few per pass rather than one per pass."""
        held = self._held
        while running + len(held) < self.max_batch:
            try:
                handle = self._queue.get(timeout=0.1) if block and not held else self._queue.get_nowait()
            except queue.Empty:
                break
            held.append(handle)
        now = time.monotonic()
        for handle in [h for h in held if h.cancelled]:
            held.remove(handle)
            self._finish(handle, "cancelled", now)
        if not held:
            return []
        if (
            running
            and running + len(held) < self.max_batch
            and now - held[0].arrival < self.join_wait_s
            and sum(len(h.prompt_ids) for h in held) < self.join_hold_tokens
        ):
            return []
        # Saturated (the held fill every free row and more wait): join once a few rows are free.
        if running and not self._queue.empty() and len(held) < min(self.join_min_rows, self.max_batch - 1):
            return []
        admitted, self._held = held, []
        return admitted

    def _emit(self, running: dict[int, tuple[RequestHandle, IncrementalText]], step: list[StepToken]) -> None:
        """Send each row's new token to its request (skipping cancelled ones); finished rows end."""
        now = time.monotonic()
        for token in step:
            handle, text = running[token.index]
            if not handle.cancelled and handle.finish_reason is None:
                self._push(handle, text, token, now)

    def _push(self, handle: RequestHandle, text: IncrementalText, token: StepToken, now: float) -> bool:
        """One token of `handle`; returns True when it ended the sequence."""
        if token.error is not None:  # this row alone failed (`RunningBatch._sample`)
            self._fail([handle], f"generation failed: {token.error}")
            return True
        handle.completion_tokens += 1
        if handle.first_token_at is None:
            handle.first_token_at = now
        delta = text.push(token.token_id, final=token.finish_reason is not None)
        reason = "stop" if text.stopped else token.finish_reason
        if reason:
            self._finish(handle, reason, now, delta)
            return True
        # One event per token, even when its text is held back: streaming clients
        # see every token arrive (a replay measures TTFT from the first chunk).
        handle.sink(Event(delta))
        return False

    def _fail(self, handles: Iterable[RequestHandle], message: str = SHUTDOWN, status: int = 500) -> None:
        for handle in handles:
            if handle.finish_reason is None:
                handle.finish_reason = "error"
                handle.sink(Event("", error=message, status=status))

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
        # After the metrics: a client that has its last event may scrape /metrics at once.
        handle.sink(Event(text, finish_reason=reason))

    def _run(self, batch: list[RequestHandle]) -> None:
        texts = [IncrementalText(self.backend.tokenizer, h.prompt_ids, h.stop) for h in batch]
        done: set[int] = set()
        try:
            for step in self.backend.generate([h.prompt_ids for h in batch], [h.params for h in batch], done):
                now = time.monotonic()
                for token in step:
                    i, handle = token.index, batch[token.index]
                    if not handle.cancelled and self._push(handle, texts[i], token, now):
                        done.add(i)
                for i, handle in enumerate(batch):
                    if self._closing.is_set() and handle.finish_reason is None:
                        done.add(i)
                        self._fail([handle], SHUTDOWN, 503)
                    elif handle.cancelled and i not in done:
                        done.add(i)
                        self._finish(handle, "cancelled", now)
        except Exception as exc:  # a failed batch fails its requests; the server keeps serving
            log.exception("batch of %d sequences failed", len(batch))
            self._fail(batch, f"generation failed: {exc}")
