"""The chat page at / in a real headless browser (Debian's chromium through playwright): load it, send
a message, wait for the streamed answer, check it against the API's greedy answer, save a screenshot.

Skips with the reason when playwright or a chromium binary is missing (`apt-get install chromium`;
`pip install playwright`, no browser download needed: the system chromium is used)."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_serve_helpers import load_test_tokenizer, tiny_chat_dir  # noqa: F401

CHROMIUM = os.environ.get("MOEINF_CHROMIUM") or next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)


def serve_in_thread(app) -> tuple[str, object, threading.Thread, socket.socket]:
    from moeinf.serve.app import make_server

    srv = make_server(app, graceful_s=5, log_level="warning")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", srv, thread, sock


def chat_in_browser(url: str, message: str, screenshot: Path, *, timeout_s: float = 120,
                    max_tokens: int = 6) -> dict[str, str]:
    """Send `message` on the page at `url`; returns the answer and the header's figures once streamed."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 640})
            page.goto(url)
            page.wait_for_function("document.getElementById('model').textContent !== '…'")
            page.fill("#max-tokens", str(max_tokens))
            page.fill("#input", message)
            page.press("#input", "Enter")
            page.wait_for_selector(".assistant[data-state=done]", timeout=timeout_s * 1000)
            # the hit ratio comes from /metrics, refreshed when the answer ends
            page.wait_for_function("document.getElementById('hits').textContent !== '-'", timeout=10_000)
            page.screenshot(path=str(screenshot))
            return {
                "answer": page.inner_text(".assistant"),
                "speed": page.inner_text("#speed"),
                "hits": page.inner_text("#hits"),
                "errors": " ".join(page.locator(".error").all_inner_texts()),
            }
        finally:
            browser.close()


def test_chat_page_streams_an_answer_in_chromium(tiny_chat_dir, tmp_path: Path) -> None:  # noqa: F811
    if CHROMIUM is None:
        pytest.skip("no chromium browser installed (apt-get install chromium, or set MOEINF_CHROMIUM)")
    pytest.importorskip("playwright", reason="playwright is not installed (pip install playwright)")
    from transformers import AutoModelForCausalLM

    from moeinf.serve.app import create_app
    from moeinf.serve.backend import HFBackend

    # The unmodified model (the page is under test, not the runtime), with runtime counters for /metrics.
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_dir).eval()
    counters = {"accesses": 40, "hits": 30, "misses": 10, "hit_rate": 0.75}
    backend = HFBackend(model, load_test_tokenizer(tiny_chat_dir), name="tiny", stats_fn=lambda: counters)
    url, srv, thread, sock = serve_in_thread(create_app(backend, max_batch=4))
    message = "what is the capital of france"
    try:
        shown = chat_in_browser(url, message, tmp_path / "chat.png")
        want = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": message}],
                "max_tokens": 6,
                "temperature": 0,
            },
            timeout=120,
        ).json()["choices"][0]["message"]["content"]
    finally:
        srv.should_exit = True
        thread.join(30)
        sock.close()
        backend.close()
    assert not shown["errors"]
    assert shown["answer"] == want and want.strip()
    assert float(shown["speed"]) > 0
    assert shown["hits"] == "75.0%"
    assert (tmp_path / "chat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_page_over_the_offloaded_zoo_model(tmp_path: Path) -> None:
    """The page over what `moeinf serve` runs by default for the shipped model (experts offloaded at 25%,
    its EAMC): the header shows the runtime's own hit ratio. MOEINF_SCREENSHOT=path also saves the
    screenshot there (docs/chat-page.png is made so)."""
    if CHROMIUM is None:
        pytest.skip("no chromium browser installed (apt-get install chromium, or set MOEINF_CHROMIUM)")
    pytest.importorskip("playwright", reason="playwright is not installed (pip install playwright)")
    from moeinf import zoo
    from moeinf.config import OffloadConfig
    from moeinf.serve.app import create_app
    from moeinf.serve.loader import load_backend

    model = zoo.get_model("full")
    config = OffloadConfig(device_cache="25%", eamc=zoo.shipped_eamc("full"),
                           offload_dir=zoo.store_dir(model))
    backend = load_backend(model, config, name="moeinf-zoo-full")
    url, srv, thread, sock = serve_in_thread(create_app(backend, max_batch=4))
    try:
        shown = chat_in_browser(url, "What should I pack for a weekend of hiking?", tmp_path / "chat.png",
                                max_tokens=48)
        stats = backend.stats()
    finally:
        srv.should_exit = True
        thread.join(30)
        sock.close()
        backend.close()
    assert not shown["errors"] and shown["answer"].strip()
    assert shown["hits"] == f"{100 * stats['hit_rate']:.1f}%" and stats["accesses"] > 0
    target = os.environ.get("MOEINF_SCREENSHOT")
    if target:
        shutil.copyfile(tmp_path / "chat.png", target)
