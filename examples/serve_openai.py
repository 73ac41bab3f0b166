"""Serve a model with `moeinf serve` and call it with the official `openai` client.

    python examples/serve_openai.py                        # the zoo model, on a free local port
    python examples/serve_openai.py path/to/checkpoint

The server speaks the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions, streamed or not)
plus /health and /metrics (Prometheus) on 127.0.0.1. This script starts it, waits for /health, asks one
streamed chat question, prints the server's metrics line for expert hits, and stops it with Ctrl-C's signal.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from openai import OpenAI

from moeinf.zoo import get_model


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with status {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the server did not answer {url}/health within {timeout_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", nargs="?", help="HuggingFace checkpoint directory (default: zoo model)")
    args = parser.parse_args()

    model_dir = args.model_dir or str(get_model("full"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "moeinf.cli", "serve", model_dir, "--port", str(port),
                               "--device-cache", "50%"])
    try:
        wait_healthy(url, server)
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")  # no --api-key: the server is open locally
        model = client.models.list().data[0].id
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=24,
            temperature=0, stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
        print()
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        print("\n".join(line for line in metrics.splitlines() if "hit" in line and not line.startswith("#")))
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
