"""Serve a model with `moeinf serve` and call it with the official `openai` client.

    python examples/serve_openai.py                        # the zoo model, on a free local port
    python examples/serve_openai.py path/to/checkpoint --log server.log

The server speaks the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions, streamed or not)
plus /health and /metrics (Prometheus) on 127.0.0.1. This script starts it, waits for /health, asks one
streamed chat question, prints the server's metrics lines for tokens and expert hits, and stops it with
Ctrl-C's signal. The server's own log goes to a file (--log; default: in a temporary directory), so what
this script prints is only the answer and the metrics.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from openai import OpenAI


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen, log_path: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with status {server.returncode} (its log: {log_path})")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the server did not answer {url}/health within {timeout_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="full",
                        help="checkpoint directory, zoo model name or HuggingFace id (default: full)")
    parser.add_argument("--log", default=None,
                        help="the server's log file (default: in a temporary directory)")
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(args.log or Path(tempfile.mkdtemp(prefix="moeinf-serve-")) / "server.log")
    print(f"server log: {log_path}", file=sys.stderr)
    log = open(log_path, "w")  # noqa: SIM115 - closed in the finally below
    server = subprocess.Popen([sys.executable, "-m", "moeinf.cli", "serve", args.model, "--port", str(port),
                               "--device-cache", "50%"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, server, log_path)
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
        wanted = ("hit", "moeinf_runtime_tokens", "tokens_per_s")
        print("\n".join(line for line in metrics.splitlines()
                        if any(w in line for w in wanted) and not line.startswith("#")))
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


if __name__ == "__main__":
    main()
