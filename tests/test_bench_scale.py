"""The scale benchmark's parts on a tiny synthesised DeepSeek-V2 (same code as the full-size run): replaying a
raw routing trace routes every MoE layer as the trace did, in HF and in moeinf alike; the cgroup runner
caps a pack and reports its peak; `moeinf bench scale` writes its rows."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from moeinf.bench.replay_routing import ReplayError, RoutingCursor
from moeinf.bench.trace_routing import (
    TraceMismatch,
    detach_router_lookahead,
    install_trace_replay,
    moe_blocks,
    trace_routings,
)
from moeinf.trace.rawtrace import RawTrace, write_raw
from moeinf.zoo.synth import synth

TINY = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 16, "vocab_size": 8192}
LAYERS, EXPERTS, TOP_K = 2, 16, 6
PROMPT, NEW = 7, 6


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: on a busy 2-core machine a second OpenMP thread spins (tiny products 100x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth("deepseek-v2-lite", tmp_path_factory.mktemp("synth") / "dsv2", overrides=TINY,
                 shard_bytes=200_000)


def make_trace(path: Path, requests: int = 3, prefill: int = PROMPT, decode: int = NEW + 2) -> Path:
    """Random routing: per request a prefill step of `prefill` tokens then `decode` one-token steps."""
    rng = np.random.default_rng(0)
    traces = []
    for r in range(requests):
        steps = []
        for tokens in [prefill] + [1] * decode:
            step = {}
            for layer in range(LAYERS):
                ids = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(tokens)])
                step[layer] = (ids, np.full((tokens, TOP_K), 1 / TOP_K, dtype=np.float32))
            steps.append(step)
        traces.append(RawTrace(f"req-{r}", "chat", LAYERS, EXPERTS, TOP_K, steps))
    return write_raw(path, traces)


class IndexRecorder:
    """Forward pre-hooks on the experts modules of an HF model: the expert ids each call got."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[list[torch.Tensor]] = [[] for _ in moe_blocks(model)]
        for layer, block in enumerate(moe_blocks(model)):
            block.experts.register_forward_pre_hook(self._hook(layer))

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            self.calls[layer].append(args[1].clone())
        return hook


def test_replayed_trace_routes_hf_and_moeinf_alike(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from moeinf import MoE, OffloadConfig

    trace = make_trace(tmp_path / "trace.jsonl.gz")
    routings = trace_routings(trace, num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K, count=2,
                              positions=NEW, prompt_ids=[5, 9, 11])
    assert [r.prompt_length for r in routings] == [PROMPT, PROMPT]
    ids = routings[0].prompt_ids(TINY["vocab_size"])
    assert ids[0, :4].tolist() == [5, 9, 11, 5]

    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        own = hf(ids).logits
    cursor = RoutingCursor(routings)
    install_trace_replay(hf, cursor)
    recorder = IndexRecorder(hf)
    expected, logits = [], []
    with torch.inference_mode():
        for i, routing in enumerate(routings):
            cursor.start(i)
            expected.append(hf.generate(routing.prompt_ids(TINY["vocab_size"]), max_new_tokens=NEW,
                                        do_sample=False))
            cursor.start(i)
            logits.append(hf(expected[i]).logits)
    # Request 0, layer 1: the prefill's positions, then one per decode step, exactly the trace's ids.
    seen = torch.cat(recorder.calls[1][: NEW])
    assert torch.equal(seen, routings[0].index[: PROMPT + NEW - 1, 1])
    assert not torch.equal(logits[0][:, :PROMPT], own)  # the trace, not the random router, chose

    with MoE(model_dir, OffloadConfig(device_cache=0.4, offload_dir=str(tmp_path / "store"))) as moe:
        cursor = RoutingCursor(routings)
        install_trace_replay(moe.model, cursor)
        detach_router_lookahead(moe)
        assert moe._runtime.offloader.lookahead is None or moe._runtime.offloader.lookahead.routers is None
        for i, routing in enumerate(routings):
            cursor.start(i)
            got = moe.generate(routing.prompt_ids(TINY["vocab_size"]), max_new_tokens=NEW, do_sample=False)
            assert torch.equal(got, expected[i])
            cursor.start(i)
            with torch.inference_mode():
                assert torch.equal(moe(got).logits, logits[i])


def test_trace_of_another_geometry_or_too_short_is_refused(tmp_path: Path) -> None:
    trace = make_trace(tmp_path / "trace.jsonl.gz")
    with pytest.raises(TraceMismatch, match="the model has 3 x 16"):
        trace_routings(trace, num_layers=3, num_experts=EXPERTS, top_k=TOP_K, count=1, positions=1,
                       prompt_ids=[1])
    with pytest.raises(ReplayError, match="3 requests"):
        trace_routings(trace, num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K, count=4, positions=1,
                       prompt_ids=[1])
    with pytest.raises(ReplayError, match="0 requests"):
        trace_routings(trace, num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K, count=1, positions=50,
                       prompt_ids=[1])


# --- the memory cap ----------------------------------------------------------------------------------------
def cgroup_skip_reason() -> str | None:
    from moeinf.bench.scale import cgroups_writable

    return cgroups_writable()


def test_no_cgroup_hierarchy_is_one_clear_error(tmp_path: Path) -> None:
    from moeinf.bench.scale import MemoryCgroup, ScaleError, cgroups_writable

    reason = cgroups_writable(tmp_path)
    assert reason is not None and "no cgroup v1 memory hierarchy" in reason and "\n" not in reason
    with pytest.raises(ScaleError):
        MemoryCgroup.create("x", 1 << 30, tmp_path)


PACK = """
import sys
from moeinf.store import pack, verify
pack(sys.argv[1], sys.argv[2], progress=False)
assert not verify(sys.argv[2])
"""


def test_pack_runs_under_a_cap_smaller_than_process_plus_model(tmp_path: Path) -> None:
    """A 230 MB checkpoint packs under a 400 MiB cap that also holds the interpreter, torch and the page
    cache: holding the model whole (or its page cache unreclaimable) would not fit."""
    import subprocess
    import sys

    from moeinf.bench.scale import MemoryCgroup

    reason = cgroup_skip_reason()
    if reason is not None:
        pytest.skip(f"memory cgroups are not writable here: {reason}")
    bigger = {**TINY, "hidden_size": 512, "moe_intermediate_size": 512, "n_routed_experts": 64}
    model = synth("deepseek-v2-lite", tmp_path / "model", overrides=bigger, shard_bytes=32 << 20)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    cap = 400 << 20
    assert size > 200e6
    cgroup = MemoryCgroup.create(f"moeinf-test-{os.getpid()}", cap)
    try:
        proc = subprocess.run([sys.executable, "-c", PACK, str(model), str(tmp_path / "store")],
                              preexec_fn=lambda: cgroup.attach(os.getpid()), capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert cgroup.oom_kills == 0
        assert 0 < cgroup.peak <= cap
    finally:
        cgroup.close()
    assert (tmp_path / "store" / "experts.bin").stat().st_size > 180e6


def test_bench_scale_writes_rows_under_the_cap(model_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    from moeinf.commands.bench import run_one

    reason = cgroup_skip_reason()
    if reason is not None:
        pytest.skip(f"memory cgroups are not writable here: {reason}")
    trace = make_trace(tmp_path / "trace.jsonl.gz")
    code = run_one("scale", [str(model_dir), "--memory-cap", "1GiB", "--routing-trace", str(trace),
                             "--prompts", "1", "--new-tokens", "3", "--rows", "default,llamacpp-q8_0",
                             "--llama-bench", str(tmp_path / "no-llama-bench"),
                             "--overhead", "100MiB",
                             "--store", str(tmp_path / "store"), "--json", "--out", str(tmp_path / "out")])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = out["results"]
    skipped = rows.pop()
    assert skipped["config"] == "llamacpp-q8_0" and skipped["skipped"] and "llama-bench" in skipped["error"]
    assert out["trace_eamc"]
    assert [(r["config"], r["routing"]) for r in rows] == [("default", "own"), ("default", "replayed")]
    for row in rows:
        assert row["ok"] and not row["killed"], row
        assert row["cap_bytes"] == 1 << 30 and 0 < row["peak_bytes"] <= 1 << 30
        assert row["ms_per_token"] > 0 and row["ttft_s"] > 0 and row["decode_steps"] == 2
        assert 0 <= row["hit_ratio"] <= 1 and row["bytes_per_token"] >= 0
        assert row["major_faults_per_token"] >= 0 and row["runqueue_ms_per_token"] >= 0
    assert len(rows[1]["tokens"][0]) == 3 and rows[1]["routing"] == "replayed"
    assert (tmp_path / "out" / "scale.jsonl").read_text().count("\n") == 3
    assert (tmp_path / "out" / "scale.png").stat().st_size > 0


def test_bench_scale_refuses_mistakes_in_one_line(model_dir: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    from moeinf.commands.bench import run_one

    assert run_one("scale", [str(tmp_path), "--memory-cap", "1GiB"]) == 2
    assert run_one("scale", [str(model_dir), "--memory-cap", "lots"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 2 and all(line.startswith("moeinf bench scale: error:") for line in err)


def test_a_trace_that_cannot_serve_the_run_or_a_bad_count_is_refused_before_the_pack(
        model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from moeinf.commands.bench import run_one

    store = tmp_path / "store"
    base = [str(model_dir), "--memory-cap", "1GiB", "--store", str(store)]
    short = make_trace(tmp_path / "short.jsonl.gz", requests=1)
    assert run_one("scale", [*base, "--routing-trace", str(short), "--prompts", "2"]) == 2
    assert run_one("scale", [*base, "--routing-trace", str(short), "--new-tokens", "0"]) == 2
    assert run_one("scale", [*base[:2], "512MiB"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 3 and all(line.startswith("moeinf bench scale: error:") for line in err)
    assert "--routing-trace: " in err[0] and "2 asked for" in err[0]
    assert "--new-tokens must be >= 1" in err[1] and "1GiB or more" in err[2]
    assert not store.exists()  # refused before anything was packed


def test_accelerate_row_is_skipped_when_its_offload_folder_cannot_fit(tmp_path: Path) -> None:
    from moeinf.bench.scale import disk_shortfall

    job = {"offload_folder": str(tmp_path / "offload")}
    assert disk_shortfall(job, experts=2 << 20, budget=1 << 20) is None
    why = disk_shortfall(job, experts=1 << 62, budget=0)
    assert why is not None and "free disk or drop the row" in why


def test_trace_eamc_is_built_from_the_requests_not_replayed(tmp_path: Path) -> None:
    from moeinf.bench.trace_routing import trace_eamc, trace_routings
    from moeinf.trace.rawtrace import load_step_counts

    trace = make_trace(tmp_path / "trace.jsonl.gz", requests=5)
    chosen: list[str] = []
    trace_routings(trace, num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K, count=2, positions=NEW,
                   prompt_ids=[1, 2, 3], chosen=chosen)
    assert chosen == ["req-0", "req-1"]
    eamc = trace_eamc(trace, set(chosen), fingerprint="f" * 64, top_k=TOP_K)
    assert eamc.meta["fingerprint"] == "f" * 64 and eamc.capacity == 3
    others = {rid: counts.sum(axis=0) for rid, _, counts in load_step_counts(trace) if rid not in chosen}
    assert sorted(e.tobytes() for e in eamc.eams) == sorted(e.astype(np.float32).tobytes()
                                                            for e in others.values())


def test_llama_rows_say_how_to_get_what_they_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from moeinf.bench.scale import llama_row, llama_setup

    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    args = argparse.Namespace(llama_bench=None, gguf_bf16=None, gguf_q8_0=None, gguf_q4_0=None)
    model = tmp_path / "model"
    fields, why = llama_setup(args, model, "llamacpp-q8_0")
    assert not fields and why is not None and "llama-bench not found" in why and "--llama-bench" in why
    # A stand-in llama-bench printing what the real one prints with -o json: a prefill and a decode test.
    tool = tmp_path / "llama-bench"
    tool.write_text("#!/bin/sh\necho '[{\"n_prompt\": 5, \"n_gen\": 0, \"avg_ns\": 2000000000},"
                    " {\"n_prompt\": 0, \"n_gen\": 4, \"avg_ns\": 400000000, \"build_commit\": \"x\"}]'\n")
    tool.chmod(0o755)
    args.llama_bench = str(tool)
    fields, why = llama_setup(args, model, "llamacpp-q8_0")
    assert not fields and "no Q8_0 GGUF" in why and "--gguf-q8_0" in why
    gguf = tmp_path / "model.llamacpp" / "model-Q8_0.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    fields, why = llama_setup(args, model, "llamacpp-q8_0")
    assert why is None and fields == {"llama_bench": str(tool), "gguf": str(gguf)}
    row = llama_row({**fields, "threads": 1, "new_tokens": 4, "inputs": [[1, 2, 3, 4, 5]]})
    assert row["ok"] and row["ms_per_token"] == 100.0 and row["ttft_s"] == 2.0 and row["decode_steps"] == 4
    # the bf16 row (beside the exact store) finds its own file, or is named by --gguf-bf16
    fields, why = llama_setup(args, model, "llamacpp-bf16")
    assert not fields and "no BF16 GGUF" in why and "--gguf-bf16" in why
    args.gguf_bf16 = str(gguf)
    fields, why = llama_setup(args, model, "llamacpp-bf16")
    assert why is None and fields["gguf"] == str(gguf)


def test_set_overrides_are_offload_config_fields_checked_once() -> None:
    from moeinf.bench.scale import ScaleError, settings

    assert settings(["prefetch_min_probability=0.7", "eviction=lru"]) == {"prefetch_min_probability": 0.7,
                                                                         "eviction": "lru"}
    with pytest.raises(ScaleError, match="OffloadConfig field"):
        settings(["no_such_knob=1"])
    with pytest.raises(ScaleError, match="prefetch_min_probability"):
        settings(["prefetch_min_probability=3"])


def test_tokens_match_hf_from_this_run_or_a_previous_runs_accelerate_row(tmp_path: Path) -> None:
    import json

    from moeinf.bench.scale import ScaleError, annotate, hf_reference

    cap = 8 << 30
    acc = {"config": "accelerate", "routing": "own", "cap_bytes": cap, "ok": True, "tokens": [[1, 2, 3]]}
    rows = [{"config": "default", "routing": "own", "cap_bytes": cap, "ok": True, "tokens": [[1, 2, 3, 4]]},
            {"config": "on-demand-lru", "routing": "own", "cap_bytes": cap, "ok": True,
             "tokens": [[1, 2, 5]]},
            {"config": "default", "routing": "replayed", "cap_bytes": cap, "ok": True, "tokens": [[9]]},
            {"config": "default", "routing": "own", "cap_bytes": 2 * cap, "ok": True, "tokens": [[1, 2, 3]]}]
    annotate(rows + [acc])
    assert [r.get("tokens_match_hf") for r in rows] == [True, False, None, None]  # same cap only
    for r in rows:
        r.pop("tokens_match_hf", None)
    ref = tmp_path / "scale.jsonl"
    ref.write_text(json.dumps({"model_dir": "x", **acc}) + "\n")
    annotate(rows, hf_reference(str(ref)))
    assert [r.get("tokens_match_hf") for r in rows] == [True, False, None, None]
    assert rows[0]["hf_reference"] == str(ref)
    ref.write_text(json.dumps({**acc, "config": "default"}) + "\n")
    with pytest.raises(ScaleError, match="no accelerate row"):
        hf_reference(str(ref))
    with pytest.raises(ScaleError, match="no such file"):
        hf_reference(str(tmp_path / "missing.jsonl"))
