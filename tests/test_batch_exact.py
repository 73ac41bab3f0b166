"""Batch mode's greedy answers are HF's for the same prompts batched the same way (fp32 and bf16), and the
routing pass of route-aware grouping reads no expert."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from moeinf import MoE, OffloadConfig
from moeinf.batch.grouping import first_layer_eams, order_prompts
from moeinf.batch.jobs import Prompt
from moeinf.batch.runner import Sampling, pad_batch, run_batches
from moeinf.hf.tokenizer import load_tokenizer

TEXTS = ["hi", "the cat sat on the mat", "one two", "a longer prompt of several words here", "x y z", "ok"]


def answers(generate, tokenizer, config, batch_size: int, new_tokens: int) -> dict:
    got: dict = {}
    prompts = [Prompt(i, t) for i, t in enumerate(TEXTS)]
    run_batches(generate, tokenizer, config, prompts, batch_size, Sampling(new_tokens, ignore_eos=True),
                on_batch=lambda group, rows: got.update({p.id: r for p, r in zip(group, rows, strict=True)}))
    return got


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_batches_equal_hfs_batches(dtype: str, tiny_model_dir, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir("qwen3_moe", dtype=dtype)
    tokenizer, _ = load_tokenizer(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():
        want = answers(hf.generate, tokenizer, hf.config, 4, 12)
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache="30%")
    with MoE(model_dir, config) as moe:
        got = answers(moe.generate, tokenizer, moe.model.config, 4, 12)
        assert moe.stats()["misses"] > 0  # the experts really were offloaded
    assert got == want
    assert all(len(r) == 12 for r in got.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_continuous_batches_equal_hfs_batches(dtype: str, tiny_model_dir, tmp_path: Path) -> None:
    """All prompts join in one pass (batch size >= their count): the same left-padded batch HF generates."""
    from transformers import AutoModelForCausalLM

    from moeinf.batch.runner import run_continuous
    from moeinf.serve.backend import SamplingParams
    from moeinf.serve.loader import load_backend

    model_dir = tiny_model_dir("qwen3_moe", dtype=dtype)
    tokenizer, _ = load_tokenizer(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():
        want = answers(hf.generate, tokenizer, hf.config, len(TEXTS), 12)
    got: dict = {}
    backend = load_backend(model_dir, OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache="30%"))
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        result = run_continuous(backend.open_batch, tokenizer, [Prompt(i, t) for i, t in enumerate(TEXTS)],
                                len(TEXTS), params,
                                on_batch=lambda group, rows: got.update({group[0].id: rows[0]}))
    finally:
        backend.close()
    assert result.tokens == 12 * len(TEXTS)
    assert got == want


def test_the_routing_pass_reads_no_expert_and_records_the_first_layer(tiny_model_dir, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from moeinf.trace.router import RouterTracer

    model_dir = tiny_model_dir("qwen3_moe")
    tokenizer, _ = load_tokenizer(model_dir)
    rows = [tokenizer.encode(t) for t in TEXTS]
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache="30%", prefetch="none")
    with MoE(model_dir, config) as moe:
        moe.reset_stats()
        eams = first_layer_eams(moe, moe.model, rows, pad_id=0)
        stats = moe.stats()
        assert stats["bytes_read"] == 0 and stats["accesses"] == 0
        ordered = order_prompts([Prompt(i, t) for i, t in enumerate(TEXTS)], "route",
                                lengths={i: len(r) for i, r in enumerate(rows)}, batch_size=2, model=moe)
    assert sorted(p.id for p in ordered) == list(range(len(TEXTS)))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, mask = pad_batch(rows, 0)
    with RouterTracer(hf) as tracer, torch.inference_mode():
        hf(ids, attention_mask=mask)
        want = tracer.eams()
    assert np.array_equal(eams[:, 0], want[:, 0])
    assert eams[:, 1:].sum() == 0
    assert eams[:, 0].sum(axis=1).tolist() == [len(r) * 2 for r in rows]  # top-2 of every real token


def test_a_running_batch_after_the_routing_pass_starts_from_no_rows(tiny_model_dir, tmp_path: Path) -> None:
    """The routing pass leaves no sequence behind in the runtime: the running batch's first join used to be
    appended after the pass's stopped rows, and the first decode step after a row left failed."""
    from moeinf.batch.runner import run_continuous
    from moeinf.serve.backend import SamplingParams
    from moeinf.serve.loader import load_backend

    model_dir = tiny_model_dir("qwen3_moe")
    tokenizer, _ = load_tokenizer(model_dir)
    prompts = [Prompt(i, t) for i, t in enumerate(TEXTS * 2)]
    lengths = {p.id: len(tokenizer.encode(p.prompt)) for p in prompts}
    backend = load_backend(model_dir, OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache="30%"))
    try:
        ordered = order_prompts(prompts, "route", lengths=lengths, batch_size=4, model=backend.forward)
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        result = run_continuous(backend.open_batch, tokenizer, ordered, 4, params, join=2)
    finally:
        backend.close()
    assert result.prompts == len(prompts) and result.tokens == 3 * len(prompts)
