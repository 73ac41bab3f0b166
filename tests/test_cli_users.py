"""What users of llama.cpp and vLLM expect of the command line (issue 42), through the CLI entry point or the
API: models named by directory, zoo name or HuggingFace id (from the hub cache, without network); one store
and the shipped EAMC wherever a zoo model is named; true token counts and tokens/s; sampling flags with
llama.cpp's names and transformers' meanings; errors that name the thing and the fix; progress in logs."""

from __future__ import annotations

import builtins
import json
import logging
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
from test_serve_helpers import tiny_chat_dir  # noqa: F401

from moeinf.cli import main
from moeinf.commands.options import DEFAULT_MAX_NEW_TOKENS, EXIT_USAGE

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> Path:
    return tiny_model_dir("qwen3_moe")


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One MOEINF_CACHE for the tests that run the shipped demo model (its store is packed once)."""
    return tmp_path_factory.mktemp("moeinf-cache")


@pytest.fixture
def cache(shared_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MOEINF_CACHE", str(shared_cache))
    return shared_cache


def error_line(capsys: pytest.CaptureFixture[str], command: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"moeinf {command}: error: "), err
    return line


def hub_cache(root: Path, repo_id: str, model: Path, revision: str = REV) -> Path:
    """`model` laid out as huggingface_hub lays a download: blobs, a snapshot of links to them, refs/main."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for number, f in enumerate(sorted(model.iterdir())):
        blob = repo / "blobs" / f"{number:040x}"
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


# --- models: a directory, a zoo name, a HuggingFace id ----------------------------------------------------
def test_hub_id_runs_from_the_local_hub_cache_without_network(model: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    hub_cache(tmp_path / "hub", "acme/tiny-moe", model)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MOEINF_CACHE", str(tmp_path / "cache"))
    for revision in ([], ["--revision", REV]):
        code = main(["generate", "acme/tiny-moe", *revision, "--prompt", "hello", "--max-new-tokens", "3",
                     "--device-cache", "50%", "--json"])
        assert code == 0, capsys.readouterr().err
        assert len(json.loads(capsys.readouterr().out)["ids"]) == 3
    # packed once, in moeinf's cache (never into the hub's cache), keyed by the revision
    assert [p.name for p in (tmp_path / "cache" / "stores").iterdir()] == [f"acme--tiny-moe-{REV[:16]}"]
    assert not list((tmp_path / "hub").rglob("*.moeinf"))


def test_hub_id_not_in_the_cache_is_one_line_saying_how_to_fetch_it(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["generate", "acme/absent", "--prompt", "hi"]) == EXIT_USAGE
    line = error_line(capsys, "generate")
    assert "acme/absent is not in the local HuggingFace cache" in line and "HF_HUB_OFFLINE" in line
    assert "`hf download acme/absent`" in line and str(tmp_path / "hub") in line


def test_revision_of_a_zoo_name_or_directory_is_refused(model: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    for name, what in (("demo", "a zoo model"), (str(model), "a checkpoint directory")):
        assert main(["pack", name, "--revision", "v2", "--no-progress"]) == EXIT_USAGE
        line = error_line(capsys, "pack")
        assert line.startswith("moeinf pack: error: --revision v2: a revision belongs to a HuggingFace id")
        assert what in line


def test_a_zoo_name_brings_its_store_and_shipped_eamc_everywhere(cache: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from moeinf import MoE
    from moeinf.zoo import SHIPPED_ROOT, shipped_eamc

    assert main(["pack", "demo", "--json", "--no-progress"]) == 0
    store = Path(json.loads(capsys.readouterr().out)["store_dir"])
    assert store.parent == cache / "stores"
    with MoE("demo", {"device_cache": "25%"}) as moe:  # the API resolves names as the CLI does
        assert Path(moe.config.offload_dir) == store
        assert moe.config.eamc == str(shipped_eamc("demo"))
        assert moe.model_dir == SHIPPED_ROOT / "demo"
    with MoE(SHIPPED_ROOT / "demo", {"device_cache": "25%"}) as moe:  # named by its path: the same
        assert Path(moe.config.offload_dir) == store and moe.config.eamc == str(shipped_eamc("demo"))
    assert not list(SHIPPED_ROOT.glob("demo.moeinf*"))  # nothing packed into the package


def test_generate_demo_offloads_by_default_and_prints_tokens_per_s(cache: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "demo", "--prompt", "What is 2+3?", "--max-new-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert "device cache: 25% (the default: 25% of the experts" in err
    speed = next(line for line in err.splitlines() if line.startswith("-- prefill"))
    assert " tokens/s (" in speed and ", decode " in speed and "tokens generated" in speed


def test_chat_demo_counts_its_tokens_in_stats(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    lines = iter(["What is 2+3?", "What is 3+4?", "/stats"])

    def read(prompt: str = "") -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", read)
    assert main(["chat", "demo", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    answers = [line for line in out.splitlines() if line.startswith("[") and "tokens; prefill" in line]
    assert len(answers) == 2
    per_answer = sum(int(line[1:].split()[0]) for line in answers)
    stats = next(line for line in out.splitlines() if line.startswith("prefill "))
    assert per_answer > 0 and stats.endswith(f"{per_answer} tokens generated")
    cache_line = next(line for line in out.splitlines() if "expert accesses" in line)
    assert cache_line.startswith(f"{per_answer} tokens")


def test_serve_demo_metrics_count_tokens_and_speed(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi.testclient import TestClient

    import moeinf.serve.app

    seen: dict[str, str] = {}

    def serve(app, sock) -> None:  # instead of uvicorn: two requests in-process, then stop
        with TestClient(app, base_url="http://127.0.0.1") as client:  # a Host the server accepts
            names = [m["id"] for m in client.get("/v1/models").json()["data"]]
            tokens = 0
            for prompt in ("What is 2+3?", "What is 3+4?"):
                body = client.post("/v1/completions", json={"model": "demo", "prompt": prompt,
                                                              "max_tokens": 3}).json()
                tokens += body["usage"]["completion_tokens"]
            seen.update(names=",".join(names), tokens=str(tokens), metrics=client.get("/metrics").text)

    monkeypatch.setattr(moeinf.serve.app, "run_server", serve)
    with socket.socket() as sock:  # a free port (serve binds it before loading the model)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["serve", "demo", "--port", str(port)]) == 0
    assert seen["names"] == "demo"
    metrics = dict(line.rsplit(" ", 1) for line in seen["metrics"].splitlines() if line.startswith("moeinf_"))
    assert float(metrics["moeinf_runtime_tokens"]) == int(seen["tokens"]) > 0
    assert float(metrics["moeinf_runtime_decode_tokens_per_s"]) > 0
    assert float(metrics["moeinf_runtime_prefill_tokens_per_s"]) > 0


def test_stats_count_every_forward_pass_with_prefill_and_decode_apart(model: Path, tmp_path: Path) -> None:
    """The server and chat call the model pass by pass (not `generate`); stats() counted 0 tokens then."""
    from moeinf import MoE
    from moeinf.serve.backend import HFBackend, SamplingParams

    with MoE(model, {"device_cache": "50%", "offload_dir": str(tmp_path / "store")}) as moe:
        backend = HFBackend(moe.model, tokenizer=None, forward=moe, prefill=moe.join,
                            on_rows_kept=moe.keep_rows)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        steps = list(backend.generate([[5, 6, 7], [8, 9]], [params, params]))
        stats = moe.stats()
        assert len(steps) == 4
        assert (stats["tokens"], stats["prompt_tokens"], stats["decode_tokens"]) == (8, 5, 6)
        assert stats["prefill_tokens_per_s"] > 0 and stats["decode_tokens_per_s"] > 0
        ids = torch.tensor([[5, 6, 7]])
        moe.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
        assert moe.stats()["tokens"] == 8 + 3
        moe.reset_stats()
        assert moe.stats()["tokens"] == 0 and moe.stats()["decode_tokens_per_s"] == 0.0


# --- sampling flags -----------------------------------------------------------------------------------------
def hf_ids(model: Path, prompt: str, seed: int, **kwargs) -> list[int]:
    from transformers import AutoModelForCausalLM

    from moeinf.hf.tokenizer import load_tokenizer

    tokenizer, _ = load_tokenizer(model)
    ids = torch.tensor([tokenizer.encode(prompt)])
    hf = AutoModelForCausalLM.from_pretrained(model).eval()
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, **kwargs)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("flags, hf", [
    (["--temperature", "1", "--top-k", "3", "--top-p", "1", "--seed", "5"],
     {"do_sample": True, "temperature": 1.0, "top_k": 3, "top_p": 1.0}),
    (["--repetition-penalty", "3"], {"do_sample": False, "repetition_penalty": 3.0}),
    (["--temperature", "0.8", "--top-p", "0.9", "--top-k", "4", "--repetition-penalty", "1.3", "--seed", "1"],
     {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "top_k": 4, "repetition_penalty": 1.3}),
])
def test_sampling_flags_mean_what_transformers_means(model: Path, tmp_path: Path, flags: list[str], hf: dict,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    seed = int(flags[flags.index("--seed") + 1]) if "--seed" in flags else 0
    expected = hf_ids(model, "hello world", seed, **hf)
    for offload in (["--device-cache", "50%", "--offload-dir", str(tmp_path / "store")], ["--no-offload"]):
        code = main(["generate", str(model), "--prompt", "hello world", "--max-new-tokens", "6", "--json",
                     *offload, *flags])
        assert code == 0, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out)["ids"] == expected, offload


def test_stop_ends_the_answer_before_the_text(model: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    run = ["generate", str(model), "--prompt", "hello world", "--max-new-tokens", "12", "--json",
           "--device-cache", "50%", "--offload-dir", str(tmp_path / "store")]
    assert main(run) == 0
    full = json.loads(capsys.readouterr().out)
    stop = full["text"][len(full["text"]) // 2:][:2]
    assert stop.strip()
    assert main([*run, "--stop", stop]) == 0
    cut = json.loads(capsys.readouterr().out)
    assert cut["text"] == full["text"][: full["text"].index(stop)]
    assert len(cut["ids"]) < len(full["ids"]) and cut["ids"] == full["ids"][: len(cut["ids"])]


def test_threads_changes_torch_only_when_given(model: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    before = torch.get_num_threads()
    run = ["generate", str(model), "--prompt", "hi", "--max-new-tokens", "2", "--json", "--device-cache",
           "50%", "--offload-dir", str(tmp_path / "store")]
    try:
        torch.set_num_threads(2)
        assert main(run) == 0 and torch.get_num_threads() == 2
        assert main([*run, "--threads", "1"]) == 0 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    capsys.readouterr()


def test_chat_flags_reach_its_sampling(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import moeinf.commands.chat as chat

    sessions = []
    monkeypatch.setattr(chat, "chat_loop", lambda session, read, write: sessions.append(session) or 0)
    assert main(["chat", str(model), "--no-offload", "--top-k", "7", "--repetition-penalty", "1.2", "--stop",
                 "User:", "--stop", "\n\n", "--seed", "3", "--temperature", "0.5"]) == 0
    (session,) = sessions
    p = session.params
    assert (p.top_k, p.repetition_penalty, p.seed, p.temperature) == (7, 1.2, 3, 0.5)
    assert session.stop == ("User:", "\n\n") and p.max_tokens == DEFAULT_MAX_NEW_TOKENS


def test_server_sampler_applies_top_k_and_repetition_penalty_as_transformers() -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from moeinf.serve.running import Sampler, SamplingParams

    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    prompt = [3, 7, int(logits.argmax())]
    penalised = RepetitionPenaltyLogitsProcessor(100.0)(torch.tensor([prompt]), logits[None].clone())[0]
    sampler = Sampler(SamplingParams(max_tokens=2, temperature=0.0, repetition_penalty=100.0), prompt)
    assert not sampler.argmax and sampler(logits) == int(penalised.argmax()) != prompt[-1]
    top1 = Sampler(SamplingParams(max_tokens=2, temperature=1.0, top_k=1, seed=4))
    assert {top1(logits) for _ in range(20)} == {int(logits.argmax())}
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(max_tokens=2, top_k=-1)


# --- one vocabulary ---------------------------------------------------------------------------------------
def test_every_model_command_speaks_the_same_flags() -> None:
    from moeinf.cli import build_parser

    parser = build_parser()
    for name in ("generate", "chat", "demo", "serve"):
        command = parser.commands[name]
        flags = set(command._option_string_actions)
        assert {"--max-new-tokens", "--threads", "--device-cache", "--offload-dir"} <= flags, name
        max_new = command._option_string_actions["--max-new-tokens"].default
        assert max_new == DEFAULT_MAX_NEW_TOKENS, name
    for name in ("generate", "chat", "demo"):
        assert {"--top-k", "--repetition-penalty", "--stop", "--seed", "--top-p"} <= set(
            parser.commands[name]._option_string_actions), name
    for name in ("generate", "chat", "serve", "replay", "trace", "pack"):
        model = next(a for a in parser.commands[name]._actions if a.dest == "model_dir")
        assert model.option_strings == [] and model.metavar == "MODEL", name
    for name in ("generate", "chat", "serve", "replay"):
        assert "--no-offload" in parser.commands[name]._option_string_actions, name
    assert "--temperature" in parser.commands["trace"]._option_string_actions


def test_old_spellings_still_work_and_say_they_are_deprecated(model: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from moeinf.cli import build_parser

    args = build_parser().parse_args(["trace", str(model), "--prompts", str(model / "config.json"), "--out",
                                      "x.eamc", "--sample"])
    assert args.temperature == 1.0
    assert "--sample is deprecated; write --temperature 1" in capsys.readouterr().err
    assert main(["pack", str(model), str(tmp_path / "store"), "--no-progress", "--json"]) == 0
    assert "STORE_DIR is deprecated; write --offload-dir" in capsys.readouterr().err


# --- replay ---------------------------------------------------------------------------------------------
def test_replay_runs_the_runtime_default_policy_and_honours_prefetch(tiny_chat_dir, tmp_path: Path,  # noqa: F811
        capsys: pytest.CaptureFixture[str]) -> None:
    import shlex

    from moeinf.cli import build_parser
    from moeinf.commands import replay
    from moeinf.config import OffloadConfig

    parse = build_parser().commands["replay"].parse_args
    assert replay.policies(parse([str(tiny_chat_dir)])) == [(OffloadConfig.prefetch, OffloadConfig.eviction)]
    with pytest.raises(Exception, match="--policies and --prefetch"):
        replay.policies(parse([str(tiny_chat_dir), "--prefetch", "lookahead", "--policies", "none+lru"]))
    argv = ["replay", str(tiny_chat_dir), "--duration", "1", "--length-scale", "0.02", "--max-new-tokens",
            "2", "--batching", "continuous", "--device-cache", "50%", "--offload-dir",
            str(tmp_path / "store"),
            "--prefetch", "none", "lookahead", "--out", str(tmp_path / "out"), "--json"]
    assert main(argv) == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out)
    policies = {f"{p}+{OffloadConfig.eviction}" for p in ("none", "lookahead")}
    assert {s["policy"] for s in summary.values()} == policies
    meta = json.loads((tmp_path / "out" / "summary.json").read_text())["meta"]
    assert meta["command"] == "moeinf " + shlex.join(argv)


# --- errors: one line naming the thing and what to do -------------------------------------------------------
def test_an_unwritable_cache_names_moeinf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    # a cache that cannot be made (a read-only mode would not stop root, who runs the CI)
    monkeypatch.setenv("MOEINF_CACHE", str(tmp_path / "file" / "cache"))
    assert main(["generate", "demo", "--prompt", "hi", "--max-new-tokens", "2"]) == 1 + 1
    line = error_line(capsys, "generate")
    assert "under $MOEINF_CACHE" in line and "set MOEINF_CACHE to a writable directory" in line
    assert "--offload-dir" in line


def test_an_unwritable_model_directory_suggests_offload_dir(model: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "m"
    shutil.copytree(model, copy)
    (tmp_path / "m.moeinf").write_text("in the way")
    assert main(["generate", str(copy), "--prompt", "hi", "--max-new-tokens", "2"]) == EXIT_USAGE
    line = error_line(capsys, "generate")
    assert "beside the model" in line and "give --offload-dir" in line


def test_a_store_given_as_the_model_is_refused_before_packing(model: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from moeinf.store import pack

    pack(model, tmp_path / "store", progress=False)
    assert main(["generate", str(tmp_path / "store"), "--prompt", "hi"]) == EXIT_USAGE
    line = error_line(capsys, "generate")
    assert "is an expert store" in line and f"--offload-dir {tmp_path / 'store'}" in line
    assert not (tmp_path / "store.moeinf").exists()


def test_a_bad_eamc_file_is_named(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.eamc"
    bad.write_bytes(b"not an eamc")
    assert main(["generate", str(model), "--prompt", "hi", "--eamc", str(bad)]) == EXIT_USAGE
    line = error_line(capsys, "generate")
    assert f"--eamc {bad} is not an EAMC file" in line and "moeinf trace" in line


def test_a_prompt_line_without_a_prompt_names_the_line(model: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "p.jsonl"  # id and task may be left out, the prompt not
    prompts.write_text('{"id": 1, "task": "t", "prompt": "a"}\n{"id": 2, "text": "b"}\n')
    assert main(["trace", str(model), "--prompts", str(prompts), "--out", str(tmp_path / "x.eamc")]) != 0
    line = error_line(capsys, "trace")
    assert f'{prompts}:2: expected a JSON object with a "prompt" string' in line


@pytest.mark.parametrize("argv, command, hint", [
    (["generate", "demo", "--promt", "hi"], "generate", "--promt: did you mean --prompt"),
    (["chat", "demo", "--temprature", "0"], "chat", "did you mean --temperature?"),
    (["replay", "demo", "--prefech", "none"], "replay", "did you mean --prefetch?"),
])
def test_a_mistyped_flag_keeps_the_command_and_suggests_the_flag(argv: list[str], command: str, hint: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == EXIT_USAGE
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"moeinf {command}: error: unrecognized arguments") and hint in line


# --- progress that shows in logs ---------------------------------------------------------------------------
def test_pack_and_trace_log_progress_when_stderr_is_not_a_terminal(model: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    import moeinf.progress

    monkeypatch.setattr(moeinf.progress, "PROGRESS_EVERY_S", 0.0)
    caplog.set_level(logging.INFO, logger="moeinf.progress")
    assert main(["pack", str(model), "--offload-dir", str(tmp_path / "store")]) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "moeinf.progress"]
    assert len(lines) >= 2 and lines[-1].startswith("pack: 100%") and lines[-1].endswith("(done)")
    prompts = tmp_path / "p.jsonl"
    lines = (json.dumps({"id": i, "task": "t", "prompt": f"p {i}"}) for i in range(3))
    prompts.write_text("".join(f"{line}\n" for line in lines))
    caplog.clear()
    assert main(["trace", str(model), "--prompts", str(prompts), "--out", str(tmp_path / "x.eamc"),
                 "--max-new-tokens", "2", "--batch-size", "1", "--capacity", "2",
                 "--lookahead-depth", "0"]) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "moeinf.progress"]
    assert [line.split(" (")[0] for line in lines if line.startswith("tracing")][-1] == "tracing: 100%"


def test_the_api_says_when_it_packs(model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from moeinf import MoE

    caplog.set_level(logging.INFO)
    with MoE(model, {"device_cache": "50%", "offload_dir": str(tmp_path / "store")}):
        pass
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"packing the expert store {tmp_path / 'store'}") for m in messages)
    assert any(m.startswith("pack: 100%") for m in messages)


# --- --device-cache: one flag, one meaning, in every command and benchmark ---------------------------------
def test_every_command_and_benchmark_takes_device_cache_with_one_meaning(capsys) -> None:
    import argparse

    from moeinf.cli import build_parser
    from moeinf.commands import bench, options

    parser = build_parser()
    for name in ("generate", "chat", "demo", "serve", "replay", "batch"):
        if name not in parser.commands:
            continue
        action = parser.commands[name]._option_string_actions["--device-cache"]
        assert action.type is options.size and action.dest == "device_cache", name
    assert set(bench.BENCHMARKS) <= set(bench.DEVICE_CACHE) | set(bench.NO_DEVICE_CACHE)
    expected = {"size": "25%", "sizes": "25%,10%", "sizes-or-min": "25%,10%", "share": 0.25}
    for name in bench.BENCHMARKS:
        try:
            module = bench.load(name)
        except bench.MissingBenchmark:
            continue
        benchmark = bench.bench_parser(name, module)
        action = benchmark._option_string_actions["--device-cache"]
        if name in bench.NO_DEVICE_CACHE:
            with pytest.raises(argparse.ArgumentTypeError, match=f"does not apply to bench {name}"):
                action.type("25%")
            continue
        flag, kind = bench.DEVICE_CACHE[name]
        value = "25%,10%" if kind.startswith("sizes") else "25%"
        assert action.type(value) == expected[kind], name
        with pytest.raises(argparse.ArgumentTypeError, match="no unit"):
            action.type("25")
        if flag != "--device-cache":  # the module's own spelling: the same field, deprecated and hidden
            old = benchmark._option_string_actions[flag]
            assert old.dest == action.dest and old.help == argparse.SUPPRESS, name
            old(benchmark, argparse.Namespace(), "0.25" if kind == "share" else value, flag)
            assert f"{flag} is deprecated; write --device-cache" in capsys.readouterr().err


def test_every_benchmark_parses_its_own_defaults() -> None:
    """`moeinf bench NAME` with nothing but what it requires must get past its parser: a default that its
    own option type refuses (bench exact's `min`) broke the benchmark for everyone who ran it plainly."""
    from moeinf.commands import bench

    required = {"--memory-cap": "8GiB", "--model": "demo", "--traces": "t.jsonl.gz", "--prompts": "p.jsonl"}
    for name in bench.BENCHMARKS:
        try:
            module = bench.load(name)
        except bench.MissingBenchmark:
            continue
        parser = bench.bench_parser(name, module)
        argv: list[str] = []
        for action in parser._actions:
            if action.required and not action.option_strings:
                argv.append("DIR")
            elif action.required:
                argv += [action.option_strings[0], required[action.option_strings[0]]]
        args = parser.parse_args(argv)  # exits (SystemExit) on a default its own type refuses
        if name == "exact":
            assert args.caches == "min,50%,100%"


def test_a_checkpoint_without_weights_is_not_called_an_unwritable_store(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    shutil.copyfile(Path(__file__).parents[1] / "moeinf" / "zoo" / "weights" / "full" / "config.json",
                    model / "config.json")
    assert main(["generate", str(model), "--prompt", "hi", "--max-new-tokens", "2"]) == 1
    line = error_line(capsys, "generate")
    assert "no *.safetensors files" in line and "cannot write" not in line and "writable" not in line


def test_an_architecture_moeinf_cannot_offload_is_a_usage_line(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "llama"
    model.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    (model / "config.json").write_text(json.dumps(config))
    assert main(["generate", str(model), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    line = error_line(capsys, "generate")
    assert "model_type 'llama' is not supported by moeinf" in line and "--debug" not in line
