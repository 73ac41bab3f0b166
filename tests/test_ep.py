"""Expert parallelism (moeinf.parallel.ep) with 2 gloo ranks on this machine, against the one-process run."""

from __future__ import annotations

import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from moeinf import MoE, OffloadConfig
from moeinf.hf.tiny import save_tiny
from moeinf.parallel.ep import spawn_local

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available in this torch build")

PROMPTS = [[5, 9, 3, 17, 22, 4, 8, 30, 11], [7, 12, 40, 3]]  # unequal lengths, left-padded below
NEW_TOKENS = 12

RANK0 = textwrap.dedent("""
    import sys, torch
    from safetensors.torch import save_file
    from moeinf import MoE, OffloadConfig
    from moeinf.parallel import ep
    model_dir, out, cache, loops = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    ids = torch.tensor({ids}); mask = torch.tensor({mask})
    with MoE(model_dir, OffloadConfig(device_cache=cache, prefetch="none")) as moe:
        for _ in range(loops):
            logits = moe(ids, attention_mask=mask).logits
            tokens = moe.generate(ids, attention_mask=mask, max_new_tokens={new}, do_sample=False,
                                  pad_token_id=0)
            print("generated", flush=True)
        moe.reset_stats()
        moe.generate(ids, attention_mask=mask, max_new_tokens={new}, do_sample=False, pad_token_id=0)
        stats = moe.stats()
    ep.release_followers()
    reads = [stats["reads"]] + [r["reads"] for r in stats["ep"]["rank_stats"]]
    save_file({{"logits": logits.contiguous(), "tokens": tokens.contiguous(),
               "steady_reads": torch.tensor(reads)}}, out)
""")


def _batch() -> tuple[list[list[int]], list[list[int]]]:
    width = max(map(len, PROMPTS))
    ids = [[0] * (width - len(p)) + p for p in PROMPTS]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS]
    return ids, mask


def _launch(model_dir: Path, out: Path, cache: str, loops: int = 1) -> list[subprocess.Popen]:
    ids, mask = _batch()
    code = RANK0.format(ids=ids, mask=mask, new=NEW_TOKENS)
    return spawn_local(2, ["-c", code, str(model_dir), str(out), cache, str(loops)], timeout_s=120,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str]]:
    results = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("an expert-parallel rank hung")
        results.append((proc.returncode, err))
    return results


@pytest.mark.parametrize("family,dtype,overrides", [
    ("qwen3_moe", "bfloat16", dict(num_experts=32, num_experts_per_tok=8)),
    ("mixtral", "float32", dict(num_local_experts=16, num_experts_per_tok=4)),
    ("deepseek_v3", "bfloat16", dict(n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4)),
])
def test_two_ranks_equal_one_process(tmp_path: Path, family: str, dtype: str, overrides: dict) -> None:
    model_dir = save_tiny(family, tmp_path / "model", dtype=dtype, **overrides)
    out = tmp_path / "rank0.safetensors"
    # 60% of the experts per rank, 2 ranks: every rank holds all of its share after the first pass.
    results = _finish(_launch(model_dir, out, "60%", loops=2))
    for rank, (code, err) in enumerate(results):
        assert code == 0, f"rank {rank} failed: {err[-2000:]}"
    got = load_file(out)

    ids, mask = _batch()
    ids_t, mask_t = torch.tensor(ids), torch.tensor(mask)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: a float32 matmul's blocking depends on the thread count
    try:
        with MoE(model_dir, OffloadConfig(device_cache="60%", prefetch="none")) as moe:
            logits = moe(ids_t, attention_mask=mask_t).logits
            tokens = moe.generate(ids_t, attention_mask=mask_t, max_new_tokens=NEW_TOKENS, do_sample=False,
                                  pad_token_id=0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got["logits"], logits)
    assert torch.equal(got["tokens"], tokens)
    # Steady state: every expert a rank owns is resident, so no rank reads the SSD.
    assert got["steady_reads"].tolist() == [0, 0]


def test_a_dead_rank_fails_the_leader_fast(tmp_path: Path) -> None:
    model_dir = save_tiny("qwen3_moe", tmp_path / "model")
    out = tmp_path / "rank0.safetensors"
    leader, follower = _launch(model_dir, out, "60%", loops=10_000)
    deadline = time.monotonic() + 240
    assert leader.stdout is not None
    line = leader.stdout.readline()  # the first generate went through both ranks
    assert line.strip() == "generated", leader.stderr.read() if leader.stderr else ""
    follower.kill()
    follower.communicate()
    try:
        _, err = leader.communicate(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        leader.kill()
        pytest.fail("rank 0 kept waiting for a dead rank")
    assert leader.returncode != 0
    assert "EPError" in err and "expert rank" in err  # which rank a broadcast lost is not known


def test_a_dead_leader_ends_the_follower(tmp_path: Path) -> None:
    model_dir = save_tiny("qwen3_moe", tmp_path / "model")
    out = tmp_path / "rank0.safetensors"
    leader, follower = _launch(model_dir, out, "60%", loops=10_000)
    assert leader.stdout is not None
    assert leader.stdout.readline().strip() == "generated"
    leader.kill()
    leader.communicate()
    try:
        _, err = follower.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        follower.kill()
        pytest.fail("the follower kept waiting for a dead rank 0")
    assert follower.returncode == 1
    assert "rank 0 is gone" in err
