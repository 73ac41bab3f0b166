"""The OpenAI-compatible app in-process (TestClient): answers, streaming, errors, API key, 429, metrics."""

from __future__ import annotations

import json
import re
import threading

import pytest
from fastapi.testclient import TestClient
from test_serve_helpers import greedy_alone, make_tokenizer, tiny_backend, tiny_chat_dir  # noqa: F401
from waiting import until

from moeinf.serve.app import create_app
from moeinf.serve.backend import Backend
from moeinf.serve.batcher import MAX_BATCH, Batcher
from moeinf.serve.text import IncrementalText, encode_chat, encode_text


@pytest.fixture(scope="module")
def client(tiny_backend):  # noqa: F811
    with TestClient(create_app(tiny_backend, max_wait_s=0.01)) as c:
        yield c


def expected_text(backend, prompt_ids: list[int], max_tokens: int) -> str:
    tokens = greedy_alone(backend, prompt_ids, max_tokens)
    text = IncrementalText(backend.tokenizer, prompt_ids)
    return "".join(text.push(t, final=i == len(tokens) - 1) for i, t in enumerate(tokens))


def test_models_and_health(client) -> None:
    assert client.get("/health").json()["status"] == "ok"
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_completion_is_the_greedy_continuation(client, tiny_backend) -> None:  # noqa: F811
    prompt = "the quick brown fox"
    r = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    ids = encode_text(tiny_backend.tokenizer, prompt)
    assert body["choices"][0]["text"] == expected_text(tiny_backend, ids, 6)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


def test_chat_uses_the_template_and_streams_the_same_text(client, tiny_backend) -> None:  # noqa: F811
    messages = [
        {"role": "system", "content": "you are a helpful model"},
        {"role": "user", "content": "hello"},
    ]
    ids = encode_chat(tiny_backend.tokenizer, messages)
    templated = tiny_backend.tokenizer.decode(ids)
    assert templated.startswith("<s> system :") and templated.endswith("assistant :")
    body = {"model": "tiny", "messages": messages, "max_tokens": 7, "temperature": 0}
    whole = client.post("/v1/chat/completions", json=body).json()
    assert whole["choices"][0]["message"]["content"] == expected_text(tiny_backend, ids, 7)
    assert whole["usage"]["prompt_tokens"] == len(ids)
    with client.stream("POST", "/v1/chat/completions", json=dict(body, stream=True)) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_chat_content_may_be_text_parts_as_openai_clients_send(client, tiny_backend) -> None:  # noqa: F811
    plain = [{"role": "user", "content": "hello\nthere"}]
    texts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]
    parts = [{"role": "user", "content": texts}]
    answers = [client.post("/v1/chat/completions", json={"model": "tiny", "messages": m, "max_tokens": 4,
                                                         "temperature": 0}).json() for m in (plain, parts)]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    assert answers[0]["usage"] == answers[1]["usage"]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": image})
    assert r.status_code == 400 and "only text content parts" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages"


def test_fallback_chat_format_without_template(tmp_path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(make_tokenizer(tmp_path, chat_template=False))
    messages = [{"role": "user", "content": "hello there"}]
    prompt = "User: hello there\nAssistant:"
    assert encode_chat(tok, messages) == tok.encode(prompt, add_special_tokens=True)


def test_stop_string_cuts_the_text(client, tiny_backend) -> None:  # noqa: F811
    free = client.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": "hello there",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
    ).json()
    text = free["choices"][0]["text"]
    word = text.split()[2]
    cut = client.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": "hello there",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "stop": [word],
        },
    ).json()
    assert cut["choices"][0]["text"] == text[: text.index(word)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_token_id_prompt_and_ignore_eos_give_exact_lengths(client) -> None:
    r = client.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": [1, 5, 9, 11],
            "max_tokens": 9,
            "temperature": 0.7,
            "seed": 3,
            "ignore_eos": True,
        },
    )
    assert r.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13}


HI = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
BAD = [
    ("malformed json", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("missing model", "/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("missing prompt", "/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("missing messages", "/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("bad message", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "x"}]}, 400, "messages"),
    (
        "negative max_tokens",
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "max_tokens": -1},
        400,
        "max_tokens",
    ),
    (
        "huge max_tokens",
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "max_tokens": 10**9},
        400,
        "max_tokens",
    ),
    ("several prompts", "/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt"),
    ("prompt too long", "/v1/completions", {"model": "tiny", "prompt": [5] * 50000}, 400, "prompt"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("n > 1", "/v1/completions", {"model": "tiny", "prompt": "hi", "n": 2}, 400, "n"),
    ("unknown field", "/v1/completions", {"model": "tiny", "prompt": "hi", "tools": []}, 400, "tools"),
    (
        "bad temperature",
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "temperature": -1},
        400,
        "temperature",
    ),
    ("token id out of vocab", "/v1/completions", {"model": "tiny", "prompt": [1, 100000]}, 400, "prompt"),
    ("json output", "/v1/chat/completions", {**HI, "response_format": {"type": "json_object"}},
     400, "response_format"),
    ("a tool", "/v1/chat/completions", {**HI, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tools"),
    ("tool required", "/v1/chat/completions", {**HI, "tool_choice": "required"}, 400, "tool_choice"),
    ("a function", "/v1/chat/completions", {**HI, "functions": [{"name": "f"}]}, 400, "functions"),
    ("function call", "/v1/chat/completions", {**HI, "function_call": "auto"}, 400, "function_call"),
]


def test_plain_text_defaults_that_clients_send_are_served(client) -> None:
    """response_format text, no tools and tool_choice none ask for what the server does: the same answer."""
    chat = {**HI, "max_tokens": 3, "temperature": 0}
    plain = client.post("/v1/chat/completions", json=chat)
    spelled = client.post("/v1/chat/completions", json={**chat, "response_format": {"type": "text"},
                                                          "tools": [], "tool_choice": "none",
                                                          "functions": None, "function_call": "none"})
    assert plain.status_code == spelled.status_code == 200, spelled.text
    assert spelled.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_an_openai_error(client, case) -> None:
    _, path, payload, status, param = case
    if isinstance(payload, bytes):
        r = client.post(path, content=payload, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=payload)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_a_model_is_retrieved_by_its_id_as_openai_clients_do(client, tiny_backend) -> None:  # noqa: F811
    listed = client.get("/v1/models").json()["data"][0]
    got = client.get(f"/v1/models/{tiny_backend.name}")
    assert got.status_code == 200 and got.json() == listed
    other = client.get("/v1/models/gpt-9")
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"


def test_api_key(tiny_backend) -> None:  # noqa: F811
    with TestClient(create_app(tiny_backend, api_key="s3cret", max_wait_s=0.0)) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get(f"/v1/models/{tiny_backend.name}").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={}).json()["error"]["type"] == "authentication_error"


class GatedBackend(Backend):
    """Wraps a backend; generation waits until `gate` is set, so requests pile up in the queue."""

    def __init__(self, inner: Backend):
        self.inner, self.gate = inner, threading.Event()
        self.name, self.tokenizer = inner.name, inner.tokenizer
        self.context_length, self.vocab_size, self.eos_token_ids = (
            inner.context_length,
            inner.vocab_size,
            inner.eos_token_ids,
        )

    def open_batch(self):
        batch = self.inner.open_batch()
        join = batch.join

        def gated_join(*args):
            self.gate.wait(30)
            return join(*args)

        batch.join = gated_join
        return batch

    def close(self) -> None:
        pass


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_full_queue_answers_429(tiny_backend, batching) -> None:  # noqa: F811
    gated = GatedBackend(tiny_backend)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    with TestClient(create_app(gated, max_batch=1, max_queue=1, max_wait_s=0.0, batching=batching)) as c:
        results: list[int] = []
        first = threading.Thread(
            target=lambda: results.append(c.post("/v1/completions", json=body).status_code)
        )
        first.start()
        # the first request is in the (blocked) batch
        until(lambda: c.get("/health").json()["running"] == 1, "the first request to run", poll=0.01)
        second = threading.Thread(
            target=lambda: results.append(c.post("/v1/completions", json=body).status_code)
        )
        second.start()
        until(lambda: c.get("/health").json()["queue_depth"] == 1, "the second request to queue", poll=0.01)
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        gated.gate.set()
        first.join(30)
        second.join(30)
        assert results == [200, 200]


LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="[^"]*"'
SAMPLE = re.compile(
    rf"^[a-zA-Z_:][a-zA-Z0-9_:]*(\{{{LABEL}(,{LABEL})*\}})?"
    r" (-?[0-9.]+(e[-+]?[0-9]+)?|\+Inf|-Inf|NaN)$"
)


def test_metrics_parse(client) -> None:
    client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3})
    text = client.get("/metrics").text
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* .+$", line), line
            continue
        assert SAMPLE.match(line), line
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    assert samples["moeinf_time_to_first_token_seconds_count"] >= 1
    assert samples['moeinf_time_to_first_token_seconds_bucket{le="+Inf"}'] >= 1
    assert samples["moeinf_generation_tokens_total"] >= 3
    assert samples['moeinf_requests_total{endpoint="completions",outcome="200"}'] >= 1


def test_serve_checks_the_port_before_loading_the_model(tiny_chat_dir, monkeypatch, capsys) -> None:  # noqa: F811
    import socket

    import moeinf.serve.loader
    from moeinf.cli import main

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(moeinf.serve.loader, "load_backend", never)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code = main(["serve", str(tiny_chat_dir), "--port", str(port), "--device-cache", "50%"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"port {port}" in err[0] and "--port" in err[0]


@pytest.mark.parametrize("bad", ["missing", "file"])
def test_serve_refuses_a_path_that_is_no_model(tmp_path, capsys, bad) -> None:
    from moeinf.cli import main

    target = tmp_path / bad
    if bad == "file":
        target.write_text("{}")
    code = main(["serve", str(target)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and str(target) in err[0]


def test_chat_page_is_served_without_a_key(tiny_backend) -> None:  # noqa: F811
    with TestClient(create_app(tiny_backend, api_key="k")) as c:
        page = c.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "/v1/chat/completions" in page.text and "/metrics" in page.text
        assert c.get("/metrics").status_code == 401


SCHEDULER_FLAGS = ["--join-wait-s", "0.2", "--join-hold-tokens", "64", "--join-min-rows", "2",
                   "--prefill-padding", "1.25"]
SCHEDULER_KNOBS = {"join_wait_s": 0.2, "join_hold_tokens": 64, "join_min_rows": 2, "prefill_padding": 1.25}


@pytest.mark.parametrize(
    "flags, max_batch",
    [
        ([], MAX_BATCH["continuous"]),
        (["--batching", "static"], MAX_BATCH["static"]),
        (["--max-batch", "5"], 5),
    ],
)
def test_serve_gives_the_scheduler_flags_to_its_batcher(tiny_chat_dir, monkeypatch, flags,  # noqa: F811
                                                         max_batch) -> None:
    import socket
    import types

    import moeinf.serve.app
    import moeinf.serve.loader
    from moeinf.cli import main

    made: list[Batcher] = []

    class Recording(Batcher):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    stub = types.SimpleNamespace(name="m", stats=dict, close=lambda: None, context_length=64)
    monkeypatch.setattr(moeinf.serve.loader, "load_backend", lambda *a, **k: stub)
    monkeypatch.setattr(moeinf.serve.app, "Batcher", Recording)
    monkeypatch.setattr(moeinf.serve.app, "run_server", lambda app, sock: None)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    assert main(["serve", str(tiny_chat_dir), "--no-offload", "--port", port, *SCHEDULER_FLAGS, *flags]) == 0
    (batcher,) = made
    assert {k: getattr(batcher, k) for k in SCHEDULER_KNOBS} == SCHEDULER_KNOBS
    assert batcher.max_batch == max_batch


@pytest.mark.parametrize("command", ["serve", "replay"])
@pytest.mark.parametrize(
    "flag, value, hint",
    [("--join-min-rows", "0", "must be >= 1"), ("--join-hold-tokens", "many", "not a whole number"),
     ("--prefill-padding", "0.5", "must be >= 1"), ("--prefill-padding", "inf", "finite")],
)
def test_bad_scheduler_flags_are_one_line(tiny_chat_dir, capsys, command, flag, value, hint) -> None:  # noqa: F811
    from moeinf.cli import main

    model = [str(tiny_chat_dir)] if command == "serve" else ["--model", str(tiny_chat_dir)]
    assert main([command, *model, flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"moeinf {command}: error: ")
    assert flag in err[0] and hint in err[0]


def test_several_prompts_in_one_request_say_so(client) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b", "c"]})
    assert r.status_code == 400 and "holds 3 prompts" in r.json()["error"]["message"]
