"""The benchmarks around quantised stores: the per-token time breakdown and `bench llamacpp`'s refusals."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

from moeinf import OffloadConfig
from moeinf.bench import llamacpp
from moeinf.bench.decode_profile import CPU_PARTS, PARTS, profile_decode


def test_decode_profile_splits_every_decoded_token(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("qwen3_moe")
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache=0.3)
    inputs = [torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    result = profile_decode(model_dir, config, inputs[:1], inputs[1:], new_tokens=5)
    # the gaps between consecutive decode steps of the two measured prompts, each decoding all 5 tokens
    # whatever it generates (no end-of-sequence stop, as llama.cpp's loop)
    assert result["steps"] == 2 * 4
    assert [len(tokens) for tokens in result["tokens"]] == [5, 5]
    parts = result["parts_ms"]
    assert set(parts) == set(PARTS)
    assert parts["expert_compute"] > 0 and parts["dense_and_framework"] > 0 and parts["reads"] >= 0
    assert sum(parts.values()) == pytest.approx(result["mean_ms"], rel=1e-6)
    # the CPU-time split of the decoding thread: no part negative, none above its wall time
    cpu = result["cpu_parts_ms"]
    assert set(cpu) == set(CPU_PARTS)
    assert all(cpu[part] >= 0 for part in CPU_PARTS) and cpu["expert_compute"] > 0
    assert result["median_cpu_ms"] > 0
    assert cpu["expert_compute"] <= parts["expert_compute"] * 1.05 + 0.05
    assert result["stats"]["misses"] > 0  # a 30% cache really offloaded


def test_bench_llamacpp_without_llama_cpp_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    parser = argparse.ArgumentParser()
    llamacpp.add_arguments(parser)
    assert llamacpp.run(parser.parse_args(["full"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'moeinf[llamacpp]'" in err[0]


def test_equal_dram_needs_a_working_memory_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoLock:
        def mlock(self, *args: object) -> int:
            return -1

    monkeypatch.setattr(llamacpp.ctypes, "CDLL", lambda *a, **k: NoLock())
    with pytest.raises(llamacpp.Refusal, match="mlock of 64 MiB is not permitted"):
        llamacpp.check_mlock()


def test_llama_cpp_conversion_of_deepseek_without_q_lora(tmp_path: Path) -> None:
    """llama.cpp loads a DeepSeek GGUF without q-LoRA only with q_lora_rank written (as 0), and routes
    DeepSeek-V3 by sigmoid only when the gating function is written."""
    import os
    import subprocess

    root = os.environ.get("LLAMA_CPP_DIR")
    if not root or not (Path(root) / "convert_hf_to_gguf.py").is_file():
        pytest.skip("needs a llama.cpp source tree in $LLAMA_CPP_DIR (the llama-cpp-python sdist's "
                    "vendor/llama.cpp)")
    from moeinf.zoo import get_model

    model_dir = get_model("full")  # DeepSeek-V3 with q_lora_rank null, and a tokenizer to convert
    out = tmp_path / "model-BF16.gguf"
    done = subprocess.run([sys.executable, "-c", llamacpp.CONVERT, root, str(model_dir), "--outtype", "bf16",
                           "--outfile", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-400:]
    sys.path.insert(0, str(Path(root) / "gguf-py"))
    try:
        import gguf
    finally:
        sys.path.pop(0)
    fields = gguf.GGUFReader(out).fields

    def value(key: str) -> int:
        field = fields[key]
        return int(field.parts[field.data[0]][0])

    assert value("deepseek2.attention.q_lora_rank") == 0
    assert value("deepseek2.expert_gating_func") == int(gguf.ExpertGatingFuncType.SIGMOID)


def test_greedy_agreement_counts_positions_and_the_common_prefix() -> None:
    same = llamacpp.agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]])
    assert same["token_agreement"] == pytest.approx(5 / 6)
    assert same["common_prefix"] == pytest.approx((2 + 2) / 2)
    assert llamacpp.agreement([[7, 8]], [[1, 8]]) == {"token_agreement": 0.5, "common_prefix": 0.0}


def test_equal_dram_refuses_a_row_whose_memory_hold_ended_early() -> None:
    """If the mlocking helper dies during llama.cpp's decode (OOM-killed first, or timed out), llama.cpp
    may have had more page cache than the budget: the row must be refused, not reported."""
    try:
        hold = llamacpp.MemoryHold(1 << 20, timeout=60).__enter__()
    except llamacpp.Refusal as exc:
        pytest.skip(f"mlock not permitted here: {exc}")
    try:
        hold.check()  # alive: no refusal
        hold.process.kill()
        hold.process.wait(timeout=30)
        with pytest.raises(llamacpp.Refusal, match="memory hold ended early"):
            hold.check()
    finally:
        hold.__exit__()


def test_llama_cpp_decodes_the_converted_zoo_model_as_hf_does(tmp_path: Path) -> None:
    """The conversion is faithful: on the bf16 GGUF, llama.cpp's greedy tokens are HF's."""
    import os

    pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional extra (moeinf[llamacpp])")
    root = os.environ.get("LLAMA_CPP_DIR")
    if not root or not (Path(root) / "convert_hf_to_gguf.py").is_file():
        pytest.skip("needs a llama.cpp source tree in $LLAMA_CPP_DIR (the llama-cpp-python sdist's "
                    "vendor/llama.cpp)")
    from transformers import AutoModelForCausalLM

    from moeinf.zoo import get_model

    model_dir = get_model("full")
    files = llamacpp.convert(model_dir, tmp_path, ["bf16"], root, threads=1)
    prompts = llamacpp.prompt_ids(model_dir, 2, 48)
    _, llama = llamacpp.llama_decode(files["bf16"], prompts, warmup=0, new_tokens=8, threads=1)
    # (b)'s loader (`--no-repack`, through the C API) decodes as `llama_cpp.Llama` does (BF16 is not repacked)
    _, unpacked = llamacpp.llama_decode(files["bf16"], prompts, warmup=0, new_tokens=8, threads=1,
                                        repack=False)
    assert unpacked == llama
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    reference = []
    for ids in prompts:
        t = torch.tensor([ids])
        out = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=8, min_new_tokens=8,
                          do_sample=False)
        reference.append(out[0, len(ids):].tolist())
    # bf16 arithmetic differs in order between the two; on this model they agreed on every token measured
    assert llamacpp.llama_top1_agreement(files["bf16"], prompts, reference, threads=1) >= 0.9
    assert llamacpp.agreement(llama, reference)["common_prefix"] >= 4


def test_memory_hold_locks_more_and_releases_on_request() -> None:
    try:
        hold = llamacpp.MemoryHold(1 << 20, timeout=60).__enter__()
    except llamacpp.Refusal as exc:
        pytest.skip(f"mlock not permitted here: {exc}")
    try:
        assert hold.locked == 1 << 20
        hold.adjust(2 << 20)
        assert hold.locked == 3 << 20
        hold.adjust(-(5 << 19))  # across the two regions
        assert hold.locked == 1 << 19
        hold.check()
    finally:
        hold.__exit__()


def test_resident_bytes_sees_what_the_page_cache_holds_of_a_file(tmp_path: Path) -> None:
    import os

    path = tmp_path / "blob"
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
    llamacpp.drop_page_cache(path)
    if llamacpp.resident_bytes(path) != 0:
        pytest.skip("this filesystem keeps the file cached after POSIX_FADV_DONTNEED")
    with open(path, "rb") as f:
        f.seek(1 << 19)
        f.read(1 << 18)
    assert 1 << 18 <= llamacpp.resident_bytes(path) <= 1 << 20
    path.read_bytes()
    assert llamacpp.resident_bytes(path) == 1 << 20


def test_calibration_reaches_the_target_when_the_kernel_reclaims_other_page_cache_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A model of the page cache: the hold's lock is taken from 3 GB of colder page cache before the GGUF
    loses a page. Steps of the excess alone (150 MB a round) would need 21 rounds; the calibration must
    get the GGUF to its target within its rounds, and keep one llama.cpp instance open throughout."""
    mb = 1 << 20
    file, target, colder = 1400 * mb, 1250 * mb, 3000 * mb

    class Hold:
        locked, pid = 0, 0

        def adjust(self, delta: int) -> None:
            self.locked += delta

        def check(self) -> None:
            pass

    hold, opened = Hold(), []
    monkeypatch.setattr(llamacpp, "decode_open", lambda llm, *args: opened.append(llm))
    monkeypatch.setattr(llamacpp, "resident_bytes", lambda path: min(file, file + colder - hold.locked))
    monkeypatch.setattr(llamacpp, "free_slack", lambda: 0)
    # reclaimable: the page cache and 300 MB of free memory (no slack above the high watermarks)
    monkeypatch.setattr(llamacpp, "reclaimable_bytes", lambda: file + colder + 300 * mb - hold.locked)
    monkeypatch.setattr(llamacpp, "anonymous_bytes", lambda pid="self": 0)
    llm = object()
    rounds = llamacpp.calibrate(hold, llm, Path("model.gguf"), target, [[1, 2]], new_tokens=4)
    assert abs(rounds[-1]["resident"] - target) <= llamacpp.CALIBRATION_TOLERANCE * target
    assert len(rounds) < llamacpp.CALIBRATION_ROUNDS
    assert set(map(id, opened)) == {id(llm)}


def test_moeinf_config_overrides_are_checked_fields_the_benchmark_does_not_set() -> None:
    def parsed(text: str) -> dict:
        return llamacpp.moeinf_overrides(argparse.Namespace(moeinf_config=text))

    assert parsed('{"attention_linears": "model"}') == [{"attention_linears": "model"}]
    assert parsed("{}") == [{}]
    assert parsed('[{"attention_linears": "model"}, {}]') == [{"attention_linears": "model"}, {}]
    with pytest.raises(ValueError, match="list of them"):
        parsed("[]")
    with pytest.raises(ValueError, match="set by the benchmark"):
        parsed('[{}, {"device_cache": 0.5}]')
    with pytest.raises(ValueError, match="not JSON"):
        parsed("attention_linears=model")
    with pytest.raises(ValueError, match="unknown OffloadConfig field"):
        parsed('{"attention": "model"}')
    with pytest.raises(ValueError, match="attention_linears"):
        parsed('{"attention_linears": "everything"}')


def test_a_llamacpp_row_carries_moeinfs_cpu_time_beside_its_wall_time(tmp_path: Path) -> None:
    from moeinf.bench.llamacpp import _line, _row

    gguf = tmp_path / "model-Q4_0.gguf"
    gguf.write_bytes(b"0" * 10)
    ours = {"median_ms": 20.0, "parts_ms": {"reads": 0.0}, "median_cpu_ms": 15.5,
            "cpu_parts_ms": {"expert_compute": 5.0}, "stats": {}, "expert_bytes": 1}
    row = _row("a-all-in-ram", "int4", "100%", [0.004, 0.005, 0.006], ours, gguf, token_agreement=1.0,
               common_prefix=3.0)
    assert row["moeinf_vs_llamacpp"] == pytest.approx(4.0)
    assert row["moeinf_cpu_ms"] == 15.5 and row["moeinf_cpu_parts_ms"] == {"expert_compute": 5.0}
    assert "moeinf   20.00 (CPU 15.50)" in _line(row)


class ModelHold:
    """A hold on a model of the page cache: `adjust` records each request and fails as the real helper is
    OOM-killed when it locks more than the kernel can free."""

    pid = 0

    def __init__(self, freeable: int) -> None:
        self.locked, self.freeable, self.requests = 0, freeable, []

    def adjust(self, delta: int) -> None:
        self.requests.append(delta)
        assert delta <= self.freeable - self.locked, "locked more than the kernel can free: OOM-killed"
        self.locked += delta

    def check(self) -> None:
        pass


def test_calibration_refuses_rather_than_locking_more_than_the_kernel_can_free(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The int4 10% row: the GGUF barely gives pages up (llama.cpp keeps them hot), so the boosted steps
    grow past what page cache and free memory hold together; the hold was OOM-killed. Now each step stops
    at what the kernel can free (free memory and page cache) less the reserve, and the row is refused with
    one line."""
    mb = 1 << 20
    file, target, freeable = 1400 * mb, 600 * mb, 3000 * mb
    hold = ModelHold(freeable)
    monkeypatch.setattr(llamacpp, "decode_open", lambda llm, *args: None)
    # llama.cpp keeps its GGUF hot: it loses a page per 20 locked, the excess barely moves, the boost doubles
    monkeypatch.setattr(llamacpp, "resident_bytes", lambda path: file - hold.locked // 20)
    monkeypatch.setattr(llamacpp, "free_slack", lambda: 0)
    monkeypatch.setattr(llamacpp, "reclaimable_bytes", lambda: freeable - hold.locked)
    monkeypatch.setattr(llamacpp, "anonymous_bytes", lambda pid="self": 0)
    with pytest.raises(llamacpp.Refusal, match="only .* MiB can be freed") as refusal:
        llamacpp.calibrate(hold, object(), Path("model.gguf"), target, [[1, 2]], new_tokens=4)
    assert "\n" not in str(refusal.value)
    assert hold.locked <= freeable - llamacpp.HOLD_RESERVE
    assert len(hold.requests) > 1


@pytest.mark.parametrize(("excess", "slack", "reclaimable", "want"), [
    (0, 0, 10_000, None),  # on target, nothing free
    (0, 3000, 10_000, 3000 - 256),  # on target, free memory the GGUF could grow into: lock it but the reserve
    (1000, 0, 10_000, 4000),  # above target, boosted
    (1000, 0, 2000, 2000 - 256),  # above target, the boost capped by what can be freed
    (-500, 0, 10_000, -500),  # below target: release
    (30, 3000, 200, None),  # within tolerance, and what is free is the reserve
])
def test_lock_step_never_locks_more_than_the_kernel_can_free(excess: int, slack: int, reclaimable: int,
                                                            want: int | None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llamacpp, "HOLD_RESERVE", 256)
    assert llamacpp.lock_step(excess, slack, reclaimable, target=1000, tolerance=50, boost=4) == want


def test_lock_step_refuses_above_target_when_nothing_more_can_be_freed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llamacpp, "HOLD_RESERVE", 256 << 20)
    with pytest.raises(llamacpp.Refusal, match="keeps 100 MiB above its target of 1000 MiB"):
        llamacpp.lock_step(100 << 20, 0, 200 << 20, target=1000 << 20, tolerance=50 << 20, boost=1)


def test_the_memory_hold_refuses_a_lock_larger_than_memory_available_and_stays_alive() -> None:
    try:
        hold = llamacpp.MemoryHold(1 << 20, timeout=60).__enter__()
    except llamacpp.Refusal as exc:
        pytest.skip(f"mlock not permitted here: {exc}")
    try:
        with pytest.raises(llamacpp.Refusal, match="would not lock .* MiB more"):
            hold.adjust(llamacpp.available_bytes("MemTotal") * 2)
        hold.check()  # alive, still holding what it held
        assert hold.locked == 1 << 20
        assert llamacpp.anonymous_bytes(hold.pid) >= 1 << 20
        hold.adjust(1 << 20)
        assert hold.locked == 2 << 20
    finally:
        hold.__exit__()


def test_budgets_are_shares_of_the_bf16_expert_bytes_unless_the_store_basis_is_asked_for() -> None:
    assert llamacpp.budget_reference("bf16", exact=1000, own=250) == 1000
    assert llamacpp.budget_reference("store", exact=1000, own=250) == 250
    assert llamacpp.budget_reference("bf16", exact=None, own=250) == 250  # no exact store beside it
    with pytest.raises(ValueError, match="--budget-basis"):
        llamacpp.budget_reference("int4", exact=1000, own=250)
    parser = argparse.ArgumentParser()
    llamacpp.add_arguments(parser)
    assert parser.parse_args(["full"]).budget_basis == "bf16"
    assert parser.parse_args(["full", "--budget-basis", "store"]).budget_basis == "store"


def test_speed_rounds_take_each_stores_median_and_the_median_of_the_rounds_ratios(
        monkeypatch: pytest.MonkeyPatch, tiny_model_dir, tmp_path: Path) -> None:
    """`--speed-rounds`: the stores decode in turn, round after round; a round on a slower machine moves
    every store's time, not the ratios."""
    from moeinf.bench import decode_profile, quant

    times = iter([100.0, 50.0, 40.0, 200.0, 100.0, 90.0, 110.0, 60.0, 30.0])  # exact, int8, int4 per round
    seen: list[str] = []

    def fake_profile(model_dir, config, warm, inputs, tokens):
        seen.append(Path(config.offload_dir).name)
        return {"median_ms": next(times), "slot_bytes": 1024}

    monkeypatch.setattr(decode_profile, "profile_decode", fake_profile)
    parser = argparse.ArgumentParser()
    quant.add_arguments(parser)
    args = parser.parse_args(["--speed-rounds", "3", "--prompts", "1", "--warmup", "0",
                              "--store-root", str(tmp_path)])
    rows = {row["store"]: row for row in quant.speed(tiny_model_dir("deepseek_v3"), args)}
    assert [name.rsplit(".", 1)[-1] for name in seen] == ["moeinf", "moeinf-int8", "moeinf-int4"] * 3
    assert rows["exact"]["median_ms"] == 110.0 and rows["exact"]["speedup"] == 1.0
    assert rows["int8"]["round_median_ms"] == [50.0, 100.0, 60.0] and rows["int8"]["median_ms"] == 60.0
    assert rows["int8"]["speedup"] == pytest.approx(2.0)
    assert rows["int4"]["round_speedups"] == pytest.approx([2.5, 200 / 90, 110 / 30])
    assert rows["int4"]["speedup"] == pytest.approx(2.5)


def test_every_kernel_candidate_computes_the_same_expert() -> None:
    """`moeinf bench quant`'s kernel table compares candidates that compute one expert alike (to each
    format's rounding), over different experts round by round, with moeinf's GEMV where it runs."""
    from moeinf.bench.quant import kernel_candidates, time_kernels
    from moeinf.kernels import gemv

    candidates = kernel_candidates(group=32, seed=0)
    assert ("int8 moeinf gemv" in candidates) == gemv.available()
    assert ("int8 moeinf gemv, int8 rows" in candidates) == gemv.available()
    x = torch.randn(1, 2048, generator=torch.Generator().manual_seed(1)).bfloat16()
    reference = candidates["bf16 F.linear"](x).float()
    for name, forward in candidates.items():
        out = forward(x).float()
        error = (out - reference).norm() / reference.norm()
        assert error < (0.02 if name.startswith("int8") else 0.2), name  # int4's grid is coarse
    lines = time_kernels(group=32, rounds=2, seed=0, experts=2)
    assert {line["kernel"] for line in lines} == set(candidates)
    assert {line["tokens"] for line in lines} == {1, 8} and all(line["median_ms"] > 0 for line in lines)


def test_all_in_ram_rounds_alternate_the_systems_and_report_the_median_round(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """(a) `--rounds`: llama.cpp and moeinf decode in turn, each opened once; a round that ran on a slower
    machine slows both, so the row is the round of the median ratio, not the medians of each system."""
    from contextlib import contextmanager

    from moeinf.bench import decode_profile

    calls: list[str] = []
    llama_ms = iter([10.0, 20.0, 10.0])
    ours_ms = iter([25.0, 30.0, 18.0])  # ratios 2.5, 1.5, 1.8: the median round is the third

    class FakeLlama:
        def close(self) -> None:
            calls.append("close")

    def fake_decode_open(llm, prompts, warmup, new_tokens):
        calls.append(f"llama {len(prompts)}")
        if warmup == len(prompts):
            return [], [[1]] * len(prompts)
        return [next(llama_ms) / 1e3] * 3, [[7, 8]] * len(prompts)

    @contextmanager
    def fake_decoder(model_dir, config, warm, new_tokens):
        calls.append(f"open {config.quant} {config.device_cache}")

        def measure(inputs):
            calls.append(f"moeinf {len(inputs)}")
            return {"median_ms": next(ours_ms), "tokens": [[7, 9]] * len(inputs), "parts_ms": {},
                    "median_cpu_ms": 0.0, "cpu_parts_ms": {}, "stats": {}, "expert_bytes": 1}

        yield measure

    monkeypatch.setattr(llamacpp, "open_llama", lambda *a, **k: FakeLlama())
    monkeypatch.setattr(llamacpp, "decode_open", fake_decode_open)
    monkeypatch.setattr(decode_profile, "decoder", fake_decoder)
    monkeypatch.setattr(llamacpp, "llama_top1_agreement", lambda *a: 0.5)
    gguf = tmp_path / "model-Q8_0.gguf"
    gguf.write_bytes(b"x" * 10)
    parser = argparse.ArgumentParser()
    llamacpp.add_arguments(parser)
    args = parser.parse_args(["full", "--rounds", "3", "--warmup", "1", "--prompts", "2"])
    prompts = [[1, 2], [3], [4, 5]]
    rows = llamacpp.all_in_ram(tmp_path, {"int8": tmp_path / "store"}, {"int8": gguf}, ["int8"], prompts,
                               [torch.tensor([p]) for p in prompts], [{}], args)
    assert calls == ["open int8 1.0", "llama 1", "llama 2", "moeinf 2", "llama 2", "moeinf 2", "llama 2",
                     "moeinf 2", "close"]
    (row,) = rows
    assert [r["moeinf_vs_llamacpp"] for r in row["rounds"]] == pytest.approx([2.5, 1.5, 1.8])
    assert row["moeinf_vs_llamacpp"] == pytest.approx(1.8) and row["llamacpp_ms"] == pytest.approx(10.0)
    assert row["token_agreement"] == pytest.approx(0.5) and row["top1_agreement"] == 0.5
    assert "rounds x2.50 x1.50 x1.80" in llamacpp._line(row)
