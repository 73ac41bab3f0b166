"""HFBackend: batched generation equals each sequence alone; rows leave the batch; sampling is seeded."""

from __future__ import annotations

import torch
from test_serve_helpers import greedy_alone, tiny_backend, tiny_chat_dir  # noqa: F401

from moeinf.serve.backend import SamplingParams


def _run(backend, prompts, params, done=None):
    outs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    reasons: dict[int, str] = {}
    for step in backend.generate(prompts, params, done if done is not None else set()):
        for t in step:
            outs[t.index].append(t.token_id)
            if t.finish_reason:
                reasons[t.index] = t.finish_reason
    return outs, reasons


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 24, (n,), generator=g).tolist()
    return [[1] + torch.randint(4, 128, (k,), generator=g).tolist() for k in lengths]


def test_batched_greedy_equals_alone(tiny_backend) -> None:  # noqa: F811
    prompts = _prompts(6)
    params = [SamplingParams(max_tokens=4 + i, temperature=0.0, ignore_eos=True) for i in range(6)]
    outs, reasons = _run(tiny_backend, prompts, params)
    for i, p in enumerate(prompts):
        assert outs[i] == greedy_alone(tiny_backend, p, 4 + i, ignore_eos=True)
        assert reasons[i] == "length"


def test_stop_token_ends_only_its_row(tiny_backend) -> None:  # noqa: F811
    prompts = _prompts(3, seed=1)
    free = _run(tiny_backend, prompts, [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 3)[
        0
    ]
    stop_tok = free[0][1]
    params = [
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stop_token_ids=frozenset({stop_tok})),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    ]
    outs, reasons = _run(tiny_backend, prompts, params)
    cut = free[0].index(stop_tok) + 1
    assert outs[0] == free[0][:cut] and reasons[0] == "stop"
    assert outs[1] == free[1] and outs[2] == free[2]


def test_done_drops_a_row_and_others_continue(tiny_backend) -> None:  # noqa: F811
    prompts = _prompts(3, seed=2)
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * 3
    free = _run(tiny_backend, prompts, params)[0]
    done: set[int] = set()
    outs: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for n, step in enumerate(tiny_backend.generate(prompts, params, done)):
        for t in step:
            outs[t.index].append(t.token_id)
        if n == 1:
            done.add(1)
    assert outs[1] == free[1][:2]
    assert outs[0] == free[0] and outs[2] == free[2]


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_backend) -> None:  # noqa: F811
    prompts = _prompts(3, seed=3)
    sampled = SamplingParams(max_tokens=8, temperature=1.5, top_p=0.9, seed=7, ignore_eos=True)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = _run(tiny_backend, prompts[:1], [sampled])[0][0]
    batched = _run(tiny_backend, prompts, [sampled, greedy, greedy])[0][0]
    other_seed = _run(
        tiny_backend, prompts[:1], [SamplingParams(max_tokens=8, temperature=1.5, seed=8, ignore_eos=True)]
    )[0][0]
    assert alone == batched
    assert alone != other_seed


def test_offloaded_backend_matches_the_hf_model(tiny_chat_dir, tiny_backend, tmp_path) -> None:  # noqa: F811
    """The CLI's default backend (moeinf.MoE) gives the HF model's greedy tokens as rows leave the batch."""
    from moeinf.config import OffloadConfig
    from moeinf.serve.loader import load_backend

    backend = load_backend(tiny_chat_dir, OffloadConfig(offload_dir=str(tmp_path / "store")), name="tiny")
    kept: list[list[int]] = []
    inner = backend._on_rows_kept
    backend._on_rows_kept = lambda keep: (kept.append(keep), inner(keep))
    try:
        prompts = _prompts(4, seed=4)
        params = [SamplingParams(max_tokens=2 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(4)]
        outs, _ = _run(backend, prompts, params)
    finally:
        backend.close()
    for i, p in enumerate(prompts):
        assert outs[i] == greedy_alone(tiny_backend, p, 2 + 2 * i, ignore_eos=True)
    assert kept == [[1, 2, 3], [1, 2], [1], []]  # the last row leaves when the batch ends
