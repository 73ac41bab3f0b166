"""The server over real HTTP on 127.0.0.1 (uvicorn in a thread): the official openai client, a client
that disconnects mid-stream, and 20 concurrent clients that each get their own greedy answer."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from test_serve_helpers import greedy_alone, tiny_backend, tiny_chat_dir  # noqa: F401

from moeinf.serve.app import create_app
from moeinf.serve.text import IncrementalText, encode_chat, encode_text


@pytest.fixture(scope="module", params=["continuous", "static"])
def server(tiny_backend, request):  # noqa: F811
    """Base URL of a live server on a free port of 127.0.0.1, batching one way; shut down after the module."""
    app = create_app(
        tiny_backend, max_batch=8, max_wait_s=0.05, max_queue=64, api_key="k", batching=request.param
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", app
    srv.should_exit = True
    thread.join(30)
    sock.close()
    assert not thread.is_alive()


def expected(backend, prompt_ids: list[int], max_tokens: int) -> str:
    tokens = greedy_alone(backend, prompt_ids, max_tokens)
    text = IncrementalText(backend.tokenizer, prompt_ids)
    return "".join(text.push(t, final=i == len(tokens) - 1) for i, t in enumerate(tokens))


def test_openai_client_completions_and_chat(server, tiny_backend) -> None:  # noqa: F811
    import openai

    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    done = client.completions.create(model="tiny", prompt="one two three", max_tokens=5, temperature=0)
    assert done.choices[0].text == expected(
        tiny_backend, encode_text(tiny_backend.tokenizer, "one two three"), 5
    )
    messages = [{"role": "user", "content": "what is the capital of france"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    want = expected(tiny_backend, encode_chat(tiny_backend.tokenizer, messages), 6)
    assert chat.choices[0].message.content == want
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == want
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=-3)
    with pytest.raises(openai.AuthenticationError):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0) as wrong:
            wrong.models.list()
    client.close()


def test_disconnect_mid_stream_frees_the_row(server, tiny_backend) -> None:  # noqa: F811
    url, app = server
    headers = {"Authorization": "Bearer k"}
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 5000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one chunk received: hang up
        deadline = time.monotonic() + 30
        while app.state.batcher.running:  # the abandoned sequence leaves its batch
            assert time.monotonic() < deadline, "the disconnected sequence kept running"
            time.sleep(0.05)
        ok = http.post(
            f"{url}/v1/completions",
            headers=headers,
            json={"model": "tiny", "prompt": "hello there", "max_tokens": 4, "temperature": 0},
        )
    assert ok.status_code == 200
    assert ok.json()["choices"][0]["text"] == expected(
        tiny_backend, encode_text(tiny_backend.tokenizer, "hello there"), 4
    )
    cancelled = app.state.metrics.registry.get_sample_value(
        "moeinf_requests_total", {"endpoint": "completions", "outcome": "cancelled"}
    )
    assert cancelled >= 1


def test_twenty_concurrent_clients_get_their_own_answers(server, tiny_backend) -> None:  # noqa: F811
    import openai

    url, _ = server
    words = "the quick brown fox jumps over lazy dog hello there how are you today paris one two".split()
    prompts = [" ".join(words[i % 12 : i % 12 + 1 + i % 5]) for i in range(20)]

    def ask(i: int) -> str:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=120)
        if i % 2:
            out = client.completions.create(
                model="tiny", prompt=prompts[i], max_tokens=3 + i % 4, temperature=0
            )
            return out.choices[0].text
        stream = client.completions.create(
            model="tiny", prompt=prompts[i], max_tokens=3 + i % 4, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in stream if c.choices)

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(ask, range(20)))
    for i, answer in enumerate(answers):
        ids = encode_text(tiny_backend.tokenizer, prompts[i])
        assert answer == expected(tiny_backend, ids, 3 + i % 4), i


def test_disconnect_of_a_non_streamed_request_frees_the_row(server) -> None:
    url, app = server
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 5000, "ignore_eos": True}
    with httpx.Client(timeout=1.0, headers={"Authorization": "Bearer k"}) as http:
        with pytest.raises(httpx.ReadTimeout):  # gives up long before 5000 tokens: the socket closes
            http.post(f"{url}/v1/completions", json=body)
    deadline = time.monotonic() + 30
    while app.state.batcher.running:
        assert time.monotonic() < deadline, "the abandoned sequence kept running"
        time.sleep(0.05)


def test_replay_against_the_live_server(server, tiny_backend) -> None:  # noqa: F811
    """`moeinf replay --url`: token-id prompts with forced output lengths, timed per request."""
    from moeinf.replay.report import summarize
    from moeinf.replay.runner import replay_remote
    from moeinf.replay.workload import WorkItem

    url, _ = server
    items = [WorkItem(i, 0.1 * i, [1] + [5 + i] * (3 + i), 2 + i, "test", 4 + i, 2 + i) for i in range(4)]
    results = replay_remote(url, items, model="tiny", api_key="k", policy="server")
    assert [r.error for r in results] == [""] * 4
    assert [r.output_tokens for r in results] == [2, 3, 4, 5]
    assert all(0 < r.ttft_s <= r.e2e_s for r in results)
    assert summarize(results)["completed"] == 4
    failed = replay_remote(url, items[:1], model="tiny", api_key="wrong", policy="server")
    assert failed[0].error.startswith("HTTP 401")


def test_replay_with_a_wrong_key_fails_with_one_line(server, tiny_chat_dir, capsys) -> None:  # noqa: F811
    from moeinf.cli import main

    url, _ = server
    args = ["replay", str(tiny_chat_dir), "--duration", "1", "--url", url, "--model-name", "tiny"]
    code = main([*args, "--api-key", "wrong"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "refused the API key" in err[0]


def test_ctrl_c_ends_open_streams(tiny_backend) -> None:  # noqa: F811
    """The signal handler aborts the batcher: an endless stream ends with an error event and [DONE],
    and the server stops, instead of waiting for the answer to end."""
    import signal

    from moeinf.serve.app import make_server

    app = create_app(tiny_backend, max_batch=4)
    srv = make_server(app, graceful_s=30, log_level="warning")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    body = {
        "model": "tiny",
        "prompt": "hello there",
        "max_tokens": 20_000,
        "ignore_eos": True,
        "stream": True,
    }
    lines = []
    try:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        if len(lines) == 3:
                            srv.handle_exit(signal.SIGINT, None)
        thread.join(30)
        assert not thread.is_alive(), "the server kept running"
    finally:
        srv.should_exit = True
        sock.close()
    assert lines[-1] == "data: [DONE]" and "shutting down" in lines[-2]
    assert len(lines) < 1000
