"""An exact store's one-row bf16 products in moeinf's kernel (`moeinf.kernels.bf16_rows`): the order of sums
csrc/bf16_rows.hpp documents, torch's bits wherever a shape is verified, torch's own product elsewhere, and
a DeepSeek-V3 model's logits HF's bit for bit with the kernel in its decode steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moeinf import MoE, OffloadConfig, _kernels
from moeinf.kernels import bf16_rows, gemv
from moeinf.kernels.bf16_rows import RowLinear

needs_kernel = pytest.mark.skipif(not bf16_rows.available(), reason="this CPU lacks AVX-512 BF16")


def blocked_pairs(x: torch.Tensor, w: torch.Tensor, k_block: int = 512) -> torch.Tensor:
    """csrc/bf16_rows.hpp's order in float32 torch ops: per block of k_block values a sum from +0 over the
    pairs (k, k + 1), k + 1's product first; the blocks' sums added in order; rounded to bf16 once."""
    xf, wf = x.float(), w.float()
    total = None
    for block in range(0, w.shape[1], k_block):
        acc = torch.zeros(w.shape[0])
        for k in range(block, min(block + k_block, w.shape[1]), 2):
            acc = acc + wf[:, k + 1] * xf[k + 1]
            acc = acc + wf[:, k] * xf[k]
        total = acc if total is None else total + acc
    return total.bfloat16()


def sequential(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Another order: one float32 sum over k = 0, 1, 2..."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(w.shape[0])
    for k in range(w.shape[1]):
        acc = acc + wf[:, k] * xf[k]
    return acc.bfloat16()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_crafted_inputs_tell_orders_of_sums_apart() -> None:
    """A probe can fail: on `crafted` rows two orders of the same float32 sums round to other bf16 values."""
    x, w = bf16_rows.crafted(256, 1024)
    differ = (bits(blocked_pairs(x, w)) != bits(sequential(x, w))).float().mean().item()
    assert differ > 0.3
    assert (bits(blocked_pairs(x, w, 512)) != bits(blocked_pairs(x, w, 256))).any()


@needs_kernel
@pytest.mark.parametrize(("rows", "cols", "k_block"), [(16, 32, 512), (64, 96, 32), (48, 1056, 512),
                                                        (32, 768, 256)])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_sums_in_the_documented_order(rows: int, cols: int, k_block: int, threads: int) -> None:
    x, w = bf16_rows.crafted(rows, cols, seed=rows)
    strided = torch.zeros(rows, cols + 64, dtype=torch.bfloat16)
    strided[:, :cols] = w  # rows further apart than K
    for weight in (w, strided[:, :cols]):
        out = torch.empty(rows, dtype=torch.bfloat16)
        pool = gemv.workers(threads) if threads > 1 else None
        _kernels.bf16_row_product(x.data_ptr(), weight.data_ptr(), weight.stride(0), rows, cols,
                                  out.data_ptr(), pool, k_block)
        assert torch.equal(bits(out), bits(blocked_pairs(x, w, k_block)))


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_verified_shapes_give_torchs_bits(threads: int) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        shapes = [(1536, 2048), (2048, 768), (128, 2048), (512, 512)]
        taken = [shape for shape in shapes if bf16_rows.verified(*shape, threads)]
        if not taken:
            pytest.skip("torch's bf16 product here does not sum in oneDNN's AVX-512 BF16 order")
        for rows, cols in taken:
            for seed in (1, 2):
                x, w = bf16_rows.crafted(rows, cols, seed=seed)
                x = x.view(1, 1, cols)
                got = bf16_rows.row_product(x, w)
                assert got is not None and got.shape == (1, 1, rows)
                assert torch.equal(bits(got), bits(F.linear(x, w)))
    finally:
        torch.set_num_threads(previous)


@needs_kernel
def test_shapes_where_torch_sums_in_that_order_are_verified() -> None:
    """Where torch's own product gives the documented order's bits (oneDNN's AVX-512 BF16 matmul), the probe
    must find the kernel's bits equal: a kernel or probe that drifted from it fails here, not silently."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, w = bf16_rows.crafted(512, 1024, seed=3)
        if not torch.equal(bits(F.linear(x.unsqueeze(0), w)[0]), bits(blocked_pairs(x, w))):
            pytest.skip("torch's bf16 product here does not sum in oneDNN's AVX-512 BF16 order")
        assert bf16_rows.verified(512, 1024, 1)
    finally:
        torch.set_num_threads(previous)


def test_what_the_kernel_cannot_take_is_torchs_product() -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 64).bfloat16()
    for w in (torch.randn(8, 64).bfloat16(), torch.randn(16, 40).bfloat16(), torch.randn(16, 64)):
        assert bf16_rows.row_product(x.to(w.dtype)[:, :w.shape[1]], w) is None
        assert torch.equal(bf16_rows.linear(x.to(w.dtype)[:, :w.shape[1]], w),
                           F.linear(x.to(w.dtype)[:, :w.shape[1]], w))
    wide = torch.randn(1, 2048).bfloat16()
    expanded = torch.randn(1, 2048).bfloat16().expand(512, 2048)  # a shape the kernel takes, rows 0 apart
    assert bf16_rows.row_product(wide, expanded) is None
    assert torch.equal(bf16_rows.linear(wide, expanded), F.linear(wide, expanded))
    rows = torch.randn(3, 64).bfloat16()  # several rows
    w = torch.randn(32, 64).bfloat16()
    assert bf16_rows.row_product(rows, w) is None
    assert torch.equal(bf16_rows.linear(rows, w), F.linear(rows, w))
    linear = torch.nn.Linear(64, 32, bias=True).bfloat16()
    with torch.no_grad():
        assert torch.equal(RowLinear(linear)(rows), linear(rows))


def test_kernel_step_runs_torch_at_one_thread_and_lends_the_outer_count_back() -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert not gemv.in_kernel_step() and gemv.compute_threads() == 2
        with gemv.kernel_step():
            assert torch.get_num_threads() == 1 and gemv.compute_threads() == 2 and gemv.in_kernel_step()
            with gemv.kernel_step():  # nested: nothing changes
                assert torch.get_num_threads() == 1 and gemv.compute_threads() == 2
            with gemv.outer_threads():
                assert torch.get_num_threads() == 2 and not gemv.in_kernel_step()
            assert torch.get_num_threads() == 1 and gemv.in_kernel_step()
        assert torch.get_num_threads() == 2 and not gemv.in_kernel_step()
        with pytest.raises(RuntimeError), gemv.kernel_step():
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 2 and not gemv.in_kernel_step()
    finally:
        torch.set_num_threads(previous)


def test_same_at_one_thread_compares_torchs_two_counts(monkeypatch) -> None:
    assert bf16_rows.same_at_one_thread(16, 64, torch.float32, 1)
    real = F.linear

    def by_threads(x, w, *args):  # a product whose last bit changes with the thread count
        out = real(x, w, *args)
        return out if torch.get_num_threads() == 1 else torch.nextafter(out, out + 1)

    monkeypatch.setattr(bf16_rows.F, "linear", by_threads)
    bf16_rows.same_at_one_thread.cache_clear()
    try:
        assert not bf16_rows.same_at_one_thread(16, 64, torch.float32, 2)
    finally:
        bf16_rows.same_at_one_thread.cache_clear()


WIDE = {"hidden_size": 512, "intermediate_size": 512, "moe_intermediate_size": 256}
"""Layers wide enough for oneDNN's matmul (and the kernel): the tiny models' products are torch's own."""


@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def kernel_calls(monkeypatch, two_threads) -> list[bool]:
    """The kernel's products, each as whether it ran in a kernel step; skips where the experts' shape of
    `WIDE` does not take the kernel."""
    if not bf16_rows.available() or not bf16_rows.verified(512, 512, 2):
        pytest.skip("torch's bf16 product of the experts' shape does not sum in oneDNN's order here")
    calls: list[bool] = []

    class Counting:  # the kernels module, its bf16 products counted
        def __getattr__(self, name):
            return getattr(_kernels, name)

        def bf16_row_product(self, *args):
            calls.append(gemv.in_kernel_step())
            return _kernels.bf16_row_product(*args)

    monkeypatch.setattr(bf16_rows, "_kernels", Counting())
    return calls


def assert_hfs_decode(model_dir: Path, store: Path, seed: int, steps: int) -> None:
    """A prompt's prefill and greedy one-row steps through moeinf (half the experts cached) are HF's."""
    from test_decode_exact import hf_logits
    from test_mla_decode import decode_logits

    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(seed))
    with MoE(model_dir, OffloadConfig(offload_dir=str(store), device_cache="50%")) as moe:
        assert isinstance(moe.model.lm_head, RowLinear)
        prefill, got = decode_logits(moe.model, ids, None, steps=steps)
    assert torch.get_num_threads() == 2
    want_prefill, want = hf_logits(model_dir, ids, None, steps=steps)
    assert torch.equal(prefill, want_prefill)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {step}"


def test_deepseek_decode_steps_with_the_kernel_give_hfs_logits_bit_for_bit(tiny_model_dir, tmp_path: Path,
                                                                           kernel_calls) -> None:
    from test_decode_exact import needs_replayed_transformers

    needs_replayed_transformers()
    model_dir = tiny_model_dir("deepseek_v3", dtype="bfloat16", q_lora_rank=64, kv_lora_rank=64, **WIDE)
    assert_hfs_decode(model_dir, tmp_path / "store", seed=6, steps=8)
    assert kernel_calls.count(True) >= 8 * 3 * 2  # 8 steps x 3 layers x the experts' two products at least


def test_a_family_without_flat_layers_gives_hfs_logits_with_the_kernel(tiny_model_dir, tmp_path: Path,
                                                                       kernel_calls) -> None:
    """Qwen3-MoE's layers run their own forward (no kernel steps): the kernel runs on the calling thread
    beside torch's OpenMP ops, and the logits stay HF's."""
    model_dir = tiny_model_dir("qwen3_moe", dtype="bfloat16", head_dim=64, **WIDE)
    assert_hfs_decode(model_dir, tmp_path / "store", seed=7, steps=6)
    assert len(kernel_calls) >= 6 * 3 * 2 and not any(kernel_calls)  # the experts' products, no kernel step


@pytest.mark.parametrize("name", ["deepseek_v3-top8", "qwen3_moe-top8"])
def test_top8_batches_of_unequal_prompts_with_the_kernel_are_hfs(name: str, tmp_path: Path,
                                                                 kernel_calls) -> None:
    """Real top-k, bf16, a padded batch of two prompts of unequal length (an expert that one row reaches
    takes the kernel), at the smallest cache and all experts cached: logits and greedy tokens are HF's."""
    from moeinf.bench.exact import compare, prepare

    case = prepare(name, "bfloat16", tmp_path, 12, sizes=WIDE)
    for cache in ("min", "100%"):
        row = compare(case, cache, OffloadConfig().prefetch, OffloadConfig().eviction, 12)
        assert row["tokens_equal"] and row["logits_equal"], row
    assert len(kernel_calls) > 0
