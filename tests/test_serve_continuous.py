"""Continuous batching: rows join and leave a running batch between steps, each answer stays its greedy
answer alone, the offloaded runtime's per-row EAMs follow their rows, and shutdown ends open requests."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from test_serve_helpers import greedy_alone, tiny_backend, tiny_chat_dir  # noqa: F401

from moeinf.serve.backend import SamplingParams
from moeinf.serve.batcher import MAX_BATCH, Batcher, Event, prefill_groups
from moeinf.serve.text import IncrementalText


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20, (n,), generator=g).tolist()
    return [[1] + torch.randint(4, 128, (k,), generator=g).tolist() for k in lengths]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _schedule(batch, prompts, lengths, joins, cancel_at=None):
    """Run `batch`: prompt i joins before step joins[i]; key `cancel_at[0]` leaves before step
    `cancel_at[1]`. Returns each key's tokens."""
    outs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    step = 0
    while step <= max(joins) or len(batch):
        new = [i for i, at in enumerate(joins) if at == step]
        if new:
            for t in batch.join(new, [prompts[i] for i in new], [_greedy(lengths[i]) for i in new]):
                outs[t.index].append(t.token_id)
        if cancel_at and cancel_at[1] == step:
            batch.leave([cancel_at[0]])
        for t in batch.step():
            outs[t.index].append(t.token_id)
        step += 1
    return outs


def test_rows_joining_and_leaving_get_their_greedy_answer_alone(tiny_backend) -> None:  # noqa: F811
    prompts = _prompts(5, seed=1)
    lengths = [9, 4, 7, 3, 6]
    joins = [0, 0, 2, 3, 6]  # 4 joins an emptied batch (3 ends at step 4; 0 is cancelled)
    batch = tiny_backend.open_batch()
    outs = _schedule(batch, prompts, lengths, joins, cancel_at=(0, 4))
    assert len(batch) == 0
    for i, p in enumerate(prompts):
        want = greedy_alone(tiny_backend, p, lengths[i], ignore_eos=True)
        assert outs[i] == (want[:5] if i == 0 else want), i  # 0 left after its 5th token


def test_the_cache_keeps_only_columns_someone_attends_to(tiny_backend) -> None:  # noqa: F811
    batch = tiny_backend.open_batch()
    long, short = [1] + [7] * 30, [1, 9]
    batch.join([0], [long], [_greedy(3)])
    batch.join([1], [short], [_greedy(8)])  # left-padded to the long row's width
    assert batch._mask.shape == (2, 31) and int(batch._mask[1].sum()) == 2
    while 0 in batch.keys:
        batch.step()
    batch.step()  # the finished long row leaves here: its columns go
    assert batch._mask.shape[0] == 1 and bool(batch._mask.all())
    assert batch._cache.get_seq_length() == batch._mask.shape[1]


def test_offloaded_rows_keep_their_own_eams(tiny_chat_dir, tmp_path) -> None:  # noqa: F811
    """Each row's EAM in the runtime equals the EAM of that sequence run alone, after joins and leaves."""
    from moeinf.config import OffloadConfig
    from moeinf.serve.loader import load_backend

    backend = load_backend(tiny_chat_dir, OffloadConfig(offload_dir=str(tmp_path / "store")), name="tiny")
    offloader = backend.forward._live().offloader
    prompts, lengths = _prompts(3, seed=7), [6, 5, 4]
    try:
        alone = []
        for p, n in zip(prompts, lengths, strict=True):
            batch = backend.open_batch()
            batch.join([0], [p], [_greedy(n)])
            for _ in range(2):
                batch.step()
            alone.append(offloader.batch.eams[0].copy())  # after the prefill and two decode steps
            batch.close()
        batch = backend.open_batch()
        batch.join([0], [prompts[0]], [_greedy(lengths[0])])
        batch.step()
        batch.join([1, 2], prompts[1:], [_greedy(n) for n in lengths[1:]])
        batch.leave([0])  # row 0 leaves; rows 1 and 2 move up
        batch.step()
        batch.step()
        assert batch.keys == [1, 2] and offloader.batch.eams.shape[0] == 2
        np.testing.assert_array_equal(offloader.batch.eams[0], alone[1])
        np.testing.assert_array_equal(offloader.batch.eams[1], alone[2])
        batch.close()
        assert offloader.batch.eams.shape[0] == 0
    finally:
        backend.close()


class _ByteTokenizer:
    """Token ids are bytes; decoding replaces an incomplete UTF-8 character, as byte-level BPE does."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_stream_deltas_never_split_a_utf8_character() -> None:
    text = "a é 中 😀 b"
    raw = list(text.encode())
    stream = IncrementalText(_ByteTokenizer(), list(b"hi "))
    deltas = [stream.push(b, final=i == len(raw) - 1) for i, b in enumerate(raw)]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    # A prompt that ends inside a character which the first tokens complete.
    euro = "€ ok".encode()
    stream = IncrementalText(_ByteTokenizer(), list(b"x") + [euro[0]])
    deltas = [stream.push(b, final=i == len(euro) - 2) for i, b in enumerate(euro[1:])]
    assert "".join(deltas) == "€ ok" and not any("\ufffd" in d for d in deltas)


def test_an_invalid_byte_from_the_model_is_still_emitted() -> None:
    stream = IncrementalText(_ByteTokenizer(), [])
    deltas = [stream.push(b) for b in [0xFF, *b"abcdef"]]
    assert "".join(deltas).startswith("\ufffdabc")


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_abort_ends_running_and_waiting_requests(tiny_backend, batching) -> None:  # noqa: F811
    """Server shutdown (Ctrl-C): every open request gets its last event, so streams close."""
    batcher = Batcher(tiny_backend, max_batch=1, max_wait_s=0.0, batching=batching)
    ended = [threading.Event(), threading.Event()]
    events: list[list[Event]] = [[], []]

    def sink(i: int):
        def put(event: Event) -> None:
            events[i].append(event)
            if event.finish_reason or event.error:
                ended[i].set()

        return put

    batcher.start()
    try:
        batcher.submit([1, 5, 6], _greedy(30_000), (), sink(0))
        batcher.submit([1, 7], _greedy(5), (), sink(1))  # waits: max_batch is 1
        for _ in range(600):
            if events[0]:
                break
            ended[0].wait(0.05)
        assert events[0], "the first request never started"
        batcher.abort()
        assert ended[0].wait(30) and ended[1].wait(30)
        assert "shutting down" in events[0][-1].error and "shutting down" in events[1][-1].error
    finally:
        batcher.close()


def test_arrivals_join_running_rows_together() -> None:
    """With rows running, an arrival waits (up to join_wait_s) for others to share its prefill pass; it
    joins at once when nothing runs, when the arrivals fill the batch, or when it has waited long enough."""
    sink = lambda event: None  # noqa: E731
    batcher = Batcher(object(), max_batch=4, join_wait_s=60.0)  # `_admit` never touches the backend
    first = batcher.submit([1, 5], _greedy(2), (), sink)
    assert batcher._admit(0, block=False) == [first]  # nothing running
    second = batcher.submit([1, 6], _greedy(2), (), sink)
    assert batcher._admit(1, block=False) == [] and batcher.queue_depth == 1  # held for company
    third, fourth = (batcher.submit([1, k], _greedy(2), (), sink) for k in (7, 8))
    assert batcher._admit(1, block=False) == [second, third, fourth]  # they fill the batch: one pass
    fifth = batcher.submit([1, 9], _greedy(2), (), sink)
    assert batcher._admit(2, block=False) == []
    batcher.join_wait_s = 0.0  # it has waited long enough
    assert batcher._admit(2, block=False) == [fifth] and batcher.queue_depth == 0


def test_a_long_prompt_is_not_held_for_company() -> None:
    """Held arrivals join as soon as their prompts hold `join_hold_tokens` tokens together: a pass that
    long reads nearly every expert anyway."""
    sink = lambda event: None  # noqa: E731
    batcher = Batcher(object(), max_batch=8, join_wait_s=60.0, join_hold_tokens=100)
    short = batcher.submit([1] * 40, _greedy(2), (), sink)
    assert batcher._admit(1, block=False) == []  # 40 tokens: held for company
    other = batcher.submit([1] * 50, _greedy(2), (), sink)
    assert batcher._admit(1, block=False) == []  # 90
    third = batcher.submit([1] * 10, _greedy(2), (), sink)
    assert batcher._admit(1, block=False) == [short, other, third]  # 100 tokens: they join now
    alone = batcher.submit([1] * 300, _greedy(2), (), sink)
    assert batcher._admit(1, block=False) == [alone]


def test_prefill_groups_put_short_prompts_first_and_never_pad_them_to_a_long_one() -> None:
    # The burst behind the slowest first tokens of the 2026-11-24 replay: 20, 20, 407 and 9 tokens.
    assert prefill_groups([20, 20, 407, 9], 1.5) == [[3, 0, 1], [2]]
    assert prefill_groups([37, 40, 35], 1.5) == [[2, 0, 1]]  # similar lengths share one pass
    assert prefill_groups([5, 100, 400], 1.5) == [[0], [1], [2]]
    assert prefill_groups([], 1.5) == []
    assert prefill_groups([3, 4, 1000], 1000.0) == [[0, 1, 2]]  # no padding bound: one pass


def test_a_burst_is_prefilled_shortest_first_and_each_pass_answers_at_once(tiny_backend) -> None:  # noqa: F811
    """Arrivals admitted together join in passes of similar lengths, short ones first; every answer stays
    its greedy answer alone."""
    passes: list[list[int]] = []

    class Recording:
        def __init__(self, batch):
            self.batch = batch

        def join(self, keys, prompts, params):
            passes.append([len(p) for p in prompts])
            return self.batch.join(keys, prompts, params)

        def __getattr__(self, name):
            return getattr(self.batch, name)

    backend = tiny_backend
    opened = backend.open_batch
    prompts = [[1] + [7, 8, 9] * 20, [1, 5, 6], [1, 9, 10, 11], [1, 12]]
    batcher = Batcher(backend, max_batch=8, join_wait_s=60.0)
    backend.open_batch = lambda: Recording(opened())  # type: ignore[method-assign]
    done = [threading.Event() for _ in prompts]
    outs: list[list[str]] = [[] for _ in prompts]

    def sink(i):
        def put(event: Event) -> None:
            outs[i].append(event.text)
            if event.finish_reason or event.error:
                done[i].set()
        return put

    try:
        for i, p in enumerate(prompts):  # queued before the thread starts: admitted in one round
            batcher.submit(p, _greedy(3), (), sink(i))
        batcher.start()
        assert all(d.wait(60) for d in done)
    finally:
        batcher.close()
        del backend.open_batch
    assert passes == [[2, 3, 4], [61]]
    for i, p in enumerate(prompts):
        text = IncrementalText(backend.tokenizer, p, ())
        want = greedy_alone(backend, p, 3, ignore_eos=True)
        expected = "".join(text.push(t, final=j == len(want) - 1) for j, t in enumerate(want))
        assert "".join(outs[i]) == expected, i


def test_a_full_batch_with_requests_queueing_refills_a_few_rows_at_a_time() -> None:
    """Saturated: freed rows are refilled once `join_min_rows` are free, so a burst joins a few per pass;
    with no queue behind them, arrivals that fill the batch join at once."""
    sink = lambda event: None  # noqa: E731
    batcher = Batcher(object(), max_batch=8, join_wait_s=0.0, join_min_rows=3)
    queued = [batcher.submit([1, k], _greedy(2), (), sink) for k in range(5, 10)]
    assert batcher._admit(7, block=False) == [] and batcher.queue_depth == 5  # one row free, four queue
    assert batcher._admit(6, block=False) == []  # two free
    assert batcher._admit(5, block=False) == queued[:3]  # three free: they join in one pass
    assert batcher._admit(6, block=False) == queued[3:]  # two free and nobody queues behind them


def test_each_scheduler_has_its_own_default_batch() -> None:
    """Continuous batching frees rows as they finish, so it runs more rows by default than static batching;
    an explicit max_batch holds for either."""
    assert Batcher(object(), batching="continuous").max_batch == MAX_BATCH["continuous"]
    assert Batcher(object(), batching="static").max_batch == MAX_BATCH["static"]
    assert MAX_BATCH["continuous"] > MAX_BATCH["static"]
    assert Batcher(object(), batching="continuous", max_batch=3).max_batch == 3
