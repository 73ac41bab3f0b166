"""Hardening of the server: a row that fails alone, sampling limits the sampler can take, malformed bodies
answered 4xx before any work, local-only defaults (JSON, Host, CORS, key from a file) and 503 at shutdown."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from fastapi.testclient import TestClient
from test_serve_helpers import greedy_alone, tiny_backend, tiny_chat_dir  # noqa: F401

import moeinf.serve.app
from moeinf.serve.app import create_app
from moeinf.serve.backend import SamplingParams
from moeinf.serve.batcher import Batcher, Event
from moeinf.serve.running import Sampler
from moeinf.serve.text import encode_text

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def client(tiny_backend):  # noqa: F811
    with TestClient(create_app(tiny_backend, max_wait_s=0.0)) as c:
        yield c


@pytest.fixture
def tokenizer_calls(monkeypatch) -> list[str]:
    """Every call of the app's tokenising functions (a refusal before tokenising leaves it empty)."""
    calls: list[str] = []
    for name in ("encode_text", "encode_chat"):
        real = getattr(moeinf.serve.app, name)

        def spy(*args, _real=real, _name=name):
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(moeinf.serve.app, name, spy)
    return calls


# --- sampling limits -------------------------------------------------------------------------------
def test_sampling_params_refuse_what_the_sampler_cannot_take() -> None:
    for bad in (dict(seed=2**64), dict(seed=-(2**63) - 1), dict(temperature=float("nan")),
                dict(temperature=-1.0), dict(top_p=0.0), dict(max_tokens=0)):
        with pytest.raises(ValueError):
            SamplingParams(**{"max_tokens": 4, **bad})
    SamplingParams(max_tokens=4, seed=2**64 - 1)
    SamplingParams(max_tokens=4, seed=-(2**63))
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    assert Sampler(SamplingParams(max_tokens=1, temperature=1e-300, seed=1))(logits) == 1  # greedy


@pytest.mark.parametrize("field, value", [("temperature", 1e-300), ("temperature", 1e-38)])
def test_tiny_temperatures_decode_greedily(client, tiny_backend, field, value) -> None:  # noqa: F811
    ids = encode_text(tiny_backend.tokenizer, "the quick brown fox")
    body = {"model": "tiny", "prompt": ids, "max_tokens": 5, "ignore_eos": True, field: value, "seed": 3}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    greedy = client.post("/v1/completions", json=dict(body, temperature=0)).json()
    assert r.json()["choices"][0]["text"] == greedy["choices"][0]["text"]


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_seeds_outside_the_generator_range_are_400(client, seed) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "seed": seed, "temperature": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "seed"


def test_max_tokens_is_bounded(client) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2**63})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


# --- one failing row ---------------------------------------------------------------------------------
POISON_SEED = 666


@pytest.fixture
def poisoned_sampler(monkeypatch):
    """Sampling with seed POISON_SEED raises at the row's 3rd token, as a bad value would on the model
    thread; other rows sample as usual."""
    real = Sampler.__call__

    def call(self, logits):
        if self.params.seed == POISON_SEED:
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls == 3:
                raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(self, logits)

    monkeypatch.setattr(Sampler, "__call__", call)


def test_a_raising_row_leaves_the_running_batch_alone(tiny_backend, poisoned_sampler) -> None:  # noqa: F811
    prompts = [[1, 5, 6, 7], [1, 9, 10], [1, 11, 12, 13, 14]]
    params = [SamplingParams(max_tokens=8, **GREEDY),
              SamplingParams(max_tokens=8, temperature=1.0, seed=POISON_SEED, ignore_eos=True),
              SamplingParams(max_tokens=8, **GREEDY)]
    batch = tiny_backend.open_batch()
    outs: dict[int, list[int]] = {0: [], 1: [], 2: []}
    errors: dict[int, str] = {}
    for t in batch.join([0, 1, 2], prompts, params):
        outs[t.index].append(t.token_id)
    while len(batch):
        for t in batch.step():
            if t.error:
                errors[t.index] = t.error
                assert t.finish_reason == "error"
            else:
                outs[t.index].append(t.token_id)
    assert list(errors) == [1] and "inf, nan" in errors[1]
    assert len(outs[1]) == 2
    for i in (0, 2):
        assert outs[i] == greedy_alone(tiny_backend, prompts[i], 8, ignore_eos=True)


def test_a_row_whose_sampler_cannot_be_made_fails_alone_at_its_first_token(tiny_backend) -> None:  # noqa: F811
    bad = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    object.__setattr__(bad, "seed", 2**70)  # past validation, as a value no check foresaw would be
    prompts = [[1, 5, 6, 7], [1, 9, 10]]
    batch = tiny_backend.open_batch()
    first = batch.join([0, 1], prompts, [SamplingParams(max_tokens=6, **GREEDY), bad])
    assert first[1].finish_reason == "error" and "Overflow" in first[1].error
    tokens = [first[0].token_id]
    while len(batch):
        tokens += [t.token_id for t in batch.step()]
    assert tokens == greedy_alone(tiny_backend, prompts[0], 6, ignore_eos=True)


def test_a_failed_prefill_fails_only_the_joining_rows(tiny_backend) -> None:  # noqa: F811
    batch = tiny_backend.open_batch()
    prompt = [1, 5, 6, 7]
    tokens = [t.token_id for t in batch.join([0], [prompt], [SamplingParams(max_tokens=6, **GREEDY)])]
    prefill = batch._prefill

    def broken(**kwargs):
        raise RuntimeError("out of memory")

    batch._prefill = broken
    with pytest.raises(RuntimeError):
        batch.join([1], [[1, 9]], [SamplingParams(max_tokens=6, **GREEDY)])
    batch._prefill = prefill
    while len(batch):
        tokens += [t.token_id for t in batch.step()]
    assert tokens == greedy_alone(tiny_backend, prompt, 6, ignore_eos=True)


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_the_batcher_fails_only_the_row_that_raised(tiny_backend, poisoned_sampler, batching) -> None:  # noqa: F811
    prompts = [[1, 5, 6, 7], [1, 9, 10], [1, 11, 12, 13, 14], [1, 20, 21]]
    params = [SamplingParams(max_tokens=8, **GREEDY) for _ in prompts]
    params[1] = SamplingParams(max_tokens=8, temperature=1.0, seed=POISON_SEED, ignore_eos=True)
    events: dict[int, list[Event]] = {i: [] for i in range(len(prompts))}
    done = threading.Semaphore(0)

    def sink_of(i):
        def sink(event: Event) -> None:
            events[i].append(event)
            if event.finish_reason or event.error:
                done.release()
        return sink

    batcher = Batcher(tiny_backend, max_wait_s=0.2, join_wait_s=0.2, batching=batching)
    batcher.start()
    try:
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            batcher.submit(p, sp, (), sink_of(i))
        for _ in prompts:
            assert done.acquire(timeout=60)
    finally:
        batcher.close()
    assert events[1][-1].error and "inf, nan" in events[1][-1].error
    for i in (0, 2, 3):
        assert events[i][-1].finish_reason == "length" and not events[i][-1].error
        assert len(events[i]) == 8


# --- malformed bodies -------------------------------------------------------------------------------
MALFORMED = [
    ("5001-digit integer", b'{"model": "tiny", "prompt": "hi", "max_tokens": ' + b"9" * 5001 + b"}"),
    ("5001-digit float", b'{"model": "tiny", "prompt": "hi", "temperature": 0.' + b"1" * 5001 + b"}"),
    ("huge exponent", b'{"model": "tiny", "prompt": "hi", "temperature": 1e400}'),
    ("NaN", b'{"model": "tiny", "prompt": "hi", "temperature": NaN}'),
    ("nested 100000 deep", b'{"model": "tiny", "prompt": "hi", "metadata": ' + b"[" * 100_000
     + b"]" * 100_000 + b"}"),
    ("nested 40 deep", b'{"model": "tiny", "prompt": "hi", "metadata": ' + b"[" * 40 + b"]" * 40 + b"}"),
    ("not UTF-8", b'{"model": "tiny", "prompt": "\xff\xfe"}'),
    ("lone surrogate prompt", b'{"model": "tiny", "prompt": "a \\ud800 b"}'),
    ("lone surrogate stop", b'{"model": "tiny", "prompt": "hi", "stop": "\\udfff"}'),
]


@pytest.mark.parametrize("case", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_completion_bodies_are_400_json(client, tokenizer_calls, case) -> None:
    r = client.post("/v1/completions", content=case[1], headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]
    assert tokenizer_calls == []


JSON = {"content-type": "application/json"}


@pytest.mark.parametrize("content", ["\\ud800", "ok \\udc00", "\\ud83d"])
def test_lone_surrogates_in_chat_are_400_before_the_tokenizer(client, tokenizer_calls, content) -> None:
    raw = '{"model": "tiny", "messages": [{"role": "user", "content": "' + content + '"}]}'
    r = client.post("/v1/chat/completions", content=raw.encode(), headers=JSON)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages"
    assert tokenizer_calls == []


def test_a_valid_surrogate_pair_is_text(client) -> None:
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "smile \\ud83d\\ude00"}], ' \
        b'"max_tokens": 1}'
    r = client.post("/v1/chat/completions", content=raw, headers=JSON)
    assert r.status_code == 200, r.text


def test_the_developer_role_is_named_in_the_roles_message(client) -> None:
    body = {"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "developer" in r.json()["error"]["message"]


def test_body_and_prompt_caps_refuse_before_reading_or_tokenising(tiny_backend, tokenizer_calls) -> None:  # noqa: F811
    app = create_app(tiny_backend, max_body_bytes=2000, max_prompt_chars=100)
    with TestClient(app) as c:
        big = {"model": "tiny", "prompt": "x" * 3000}
        r = c.post("/v1/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the cap is counted while reading
            for _ in range(10):
                yield b" " * 500
            yield json.dumps(big).encode()

        r = c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "y" * 101})
        assert r.status_code == 400 and "--max-prompt-chars" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions",
                   json={"model": "tiny", "messages": [{"role": "user", "content": "z" * 60}] * 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert tokenizer_calls == []
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "y" * 99, "max_tokens": 1})
        assert r.status_code in (200, 400) and tokenizer_calls == ["encode_text"]


def test_the_default_prompt_cap_follows_the_context_window(tiny_backend, tokenizer_calls) -> None:  # noqa: F811
    with TestClient(create_app(tiny_backend)) as c:
        prompt = "a" * (32 * tiny_backend.context_length + 1)
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt})
        assert r.status_code == 400 and tokenizer_calls == []


# --- local-only defaults ----------------------------------------------------------------------------
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_only_json_bodies_are_accepted(client, content_type) -> None:
    headers = {"content-type": content_type} if content_type else {}
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 1}'
    r = client.post("/v1/completions", content=body, headers=headers)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"
    utf8 = {"content-type": "application/json; charset=utf-8"}
    ok = client.post("/v1/completions", content=body, headers=utf8)
    assert ok.status_code == 200


def test_host_and_origin_are_checked_against_the_allowed_names(tiny_backend) -> None:  # noqa: F811
    app = create_app(tiny_backend, allowed_hosts=["127.0.0.1", "localhost", "::1"])
    with TestClient(app, base_url="http://127.0.0.1:8000") as c:
        assert c.get("/health").status_code == 200
        assert c.get("/health", headers={"host": "localhost:8000"}).status_code == 200
        assert c.get("/health", headers={"host": "[::1]:8000"}).status_code == 200
        r = c.get("/v1/models", headers={"host": "evil.example:8000"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
        r = c.post("/v1/completions", json=body, headers={"origin": "http://evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
        own = {"origin": "http://127.0.0.1:8000"}
        assert c.post("/v1/completions", json=body, headers=own).status_code == 200


def test_cors_is_closed_unless_configured(tiny_backend) -> None:  # noqa: F811
    preflight = {"origin": "http://app.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "content-type"}
    with TestClient(create_app(tiny_backend, allowed_hosts=["testserver"])) as c:
        r = c.options("/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers
    app = create_app(tiny_backend, allowed_hosts=["testserver"], cors_origins=["http://app.example"])
    with TestClient(app) as c:
        r = c.options("/v1/completions", headers=preflight)
        assert r.headers["access-control-allow-origin"] == "http://app.example"
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
                   headers={"origin": "http://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"


# --- shutdown ---------------------------------------------------------------------------------------
def test_requests_cut_by_shutdown_get_503(tiny_backend) -> None:  # noqa: F811
    from test_serve_app import GatedBackend

    gated = GatedBackend(tiny_backend)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 20, "ignore_eos": True}
    app = create_app(gated, max_batch=1, max_queue=4)
    with TestClient(app) as c:
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(c.post("/v1/completions", json=body)
                                                                  .status_code)) for _ in range(2)]
        for t in threads:
            t.start()
        batcher = app.state.batcher
        deadline = threading.Event()
        while batcher.queue_depth + batcher.running < 2 and not deadline.wait(0.02):
            pass
        batcher.abort()
        gated.gate.set()
        for t in threads:
            t.join(30)
        assert results == [503, 503]
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"


# --- the serve command's access flags ---------------------------------------------------------------
@pytest.fixture
def served(tiny_chat_dir, monkeypatch):  # noqa: F811
    """Runs `moeinf serve` with a stub model and no server; returns create_app's keyword arguments."""
    import socket
    import types

    import moeinf.serve.loader
    from moeinf.cli import main

    seen: dict = {}
    stub = types.SimpleNamespace(name="m", stats=dict, close=lambda: None, context_length=64)
    monkeypatch.setattr(moeinf.serve.loader, "load_backend", lambda *a, **k: stub)
    monkeypatch.setattr(moeinf.serve.app, "create_app", lambda backend, **kw: seen.update(kw))
    monkeypatch.setattr(moeinf.serve.app, "run_server", lambda app, sock: None)
    monkeypatch.delenv("MOEINF_API_KEY", raising=False)

    def serve(*flags: str) -> dict:
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = str(free.getsockname()[1])
        seen.clear()
        assert main(["serve", str(tiny_chat_dir), "--no-offload", "--port", port, *flags]) == 0
        return dict(seen)

    return serve


def test_the_api_key_comes_from_a_file_or_the_environment(served, tmp_path, monkeypatch, caplog) -> None:
    assert served()["api_key"] is None
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert served("--api-key-file", str(key_file))["api_key"] == "from-file"
    monkeypatch.setenv("MOEINF_API_KEY", "from-env")
    assert served()["api_key"] == "from-env"
    with caplog.at_level("WARNING"):
        assert served("--api-key", "visible")["api_key"] == "visible"
    assert "ps" in caplog.text and "--api-key-file" in caplog.text


def test_serve_help_says_where_the_key_comes_from(capsys) -> None:
    from moeinf.cli import main

    assert main(["serve", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--api-key-file" in out and "$MOEINF_API_KEY" in out


def test_serve_passes_the_host_allow_list_and_caps(served) -> None:
    kw = served()
    assert set(kw["allowed_hosts"]) == {"127.0.0.1", "localhost", "::1"} and kw["cors_origins"] == []
    kw = served("--allow-host", "box.lan", "--cors-origin", "http://ui.lan", "--max-body-bytes", "1000",
                "--max-prompt-chars", "50")
    assert "box.lan" in kw["allowed_hosts"] and kw["cors_origins"] == ["http://ui.lan"]
    assert kw["max_body_bytes"] == 1000 and kw["max_prompt_chars"] == 50
    assert served("--allow-host", "*")["allowed_hosts"] is None


@pytest.mark.parametrize("given", ["notaurl", "http://ui.lan/", "http://ui.lan/app", "http://ui.lan:99999",
                                   "localhost:3000"])
def test_a_cors_origin_that_no_browser_sends_is_refused(given: str, capsys) -> None:
    """An origin a browser never sends (a path, a trailing slash, no scheme) kept CORS closed in silence."""
    from moeinf.cli import main

    assert main(["serve", "demo", "--cors-origin", given]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cors-origin" in err[0] and "is not an origin" in err[0]


@pytest.mark.parametrize("command", [["serve", "demo"], ["replay", "demo", "--url", "http://127.0.0.1:9"]])
@pytest.mark.parametrize("given", ["", "  "])
def test_a_blank_model_name_is_refused(command: list[str], given: str, capsys) -> None:
    """No request can name a blank model id: every one would have failed with "'model' is required"."""
    from moeinf.cli import main

    assert main([*command, "--model-name", given]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"moeinf {command[0]}: error: argument --model-name: is empty" in err[0]


# --- memory -----------------------------------------------------------------------------------------
def test_the_idle_trimmer_trims_once_after_work(monkeypatch) -> None:
    import moeinf.serve.memory as memory

    calls: list[int] = []
    monkeypatch.setattr(memory, "release_free_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(memory, "available", lambda: True)
    trimmer = memory.IdleTrimmer(min_interval_s=0.0)
    trimmer.idle()
    assert calls == []  # nothing was done: nothing to give back
    trimmer.busy()
    trimmer.idle()
    trimmer.idle()
    assert calls == [1]
    slow = memory.IdleTrimmer(min_interval_s=3600.0)
    slow.busy()
    slow.idle()
    slow.busy()
    slow.idle()
    assert calls == [1, 1]  # the second waits for the interval
    off = memory.IdleTrimmer(enabled=False, min_interval_s=0.0)
    off.busy()
    off.idle()
    assert calls == [1, 1]


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_the_batcher_gives_memory_back_when_a_burst_ends(tiny_backend, batching) -> None:  # noqa: F811
    from waiting import until

    from moeinf.serve.memory import available

    if not available():
        pytest.skip("malloc_trim needs glibc")
    batcher = Batcher(tiny_backend, max_wait_s=0.0, join_wait_s=0.0, batching=batching)
    batcher.start()
    try:
        assert batcher.trimmer.trims == 0
        done = threading.Event()
        batcher.submit([1, 5, 6], SamplingParams(max_tokens=3, **GREEDY), (),
                       lambda e: done.set() if e.finish_reason or e.error else None)
        assert done.wait(30)
        until(lambda: batcher.trimmer.trims == 1, "the idle trim", poll=0.02)
    finally:
        batcher.close()
