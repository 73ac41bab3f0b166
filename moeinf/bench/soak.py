"""Soak: bursts of concurrent requests, a share of them malformed, against a real `moeinf serve` process;
the server's resident memory after each burst, and whether every good request got 200 and every bad one
a 4xx.

The server runs as a child process (`python -m moeinf serve MODEL`, default the shipped full zoo model,
offloaded with the serve command's defaults; --server-arg passes more flags; --no-memory-trim shows the
growth without the idle trim). Each burst sends --concurrency requests at once, --bad-share of them
malformed (cycling through: a 5,001-digit number, 100,000-deep nesting, a lone surrogate, a text/plain
body, a seed past 64 bits, an unknown role, an unknown field, a body over the size cap, another model,
temperature 3); the good ones are chat and completion requests over the shipped prompt sets, greedy or
sampled. After a burst the benchmark waits until the server is idle (GET /health) and reads its VmRSS.
The verdict compares RSS after the last burst with RSS after burst 5 (target: within 10%).

  moeinf bench soak --bursts 20 --concurrency 64 --out soak
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from moeinf.bench.common import machine, refuse_counts, write_jsonl

log = logging.getLogger(__name__)

PROMPT_FILES = ("mt_bench.jsonl", "gsm8k_test.jsonl", "mmlu_dev.jsonl", "self_instruct_seed.jsonl")
BASELINE_BURST = 5
"""RSS after this burst is the reference: the first bursts grow the model's working set (expert cache,
allocator pools), after which growth is what the soak looks for."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model to serve (default: the shipped full zoo model)")
    parser.add_argument("--bursts", type=int, default=20, help="bursts of requests (default 20)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests sent at once per burst")
    parser.add_argument("--bad-share", type=float, default=0.1, help="share of malformed requests (0.1)")
    parser.add_argument("--max-tokens", type=int, default=32, help="answer length of good requests")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="one more argument of `moeinf serve` (repeatable; e.g. "
                             "--server-arg=--no-memory-trim)")
    parser.add_argument("--no-memory-trim", action="store_true",
                        help="serve with --no-memory-trim (freed memory stays in the allocator: the growth "
                             "the idle trim bounds)")
    parser.add_argument("--startup-timeout", type=float, default=900.0,
                        help="seconds to wait for the server (the first use packs the store)")
    parser.add_argument("--out", default=None, help="directory for soak.jsonl")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def _prompts() -> list[str]:
    root = Path(__file__).parents[1] / "data" / "prompts"
    prompts = []
    for name in PROMPT_FILES:
        with open(root / name, encoding="utf-8") as f:
            prompts += [json.loads(line)["prompt"] for line in f if line.strip()]
    return prompts


def _bad_requests(model: str) -> list[tuple[str, str, bytes, str]]:
    """(name, path, body, content type) of each malformed request kind."""
    chat, text, js = "/v1/chat/completions", "/v1/completions", "application/json"
    ok = {"model": model, "prompt": "hello", "max_tokens": 4}
    return [
        ("huge-number", text,
         b'{"model": "%s", "prompt": "hi", "max_tokens": %s}' % (model.encode(), b"9" * 5001), js),
        ("deep-nesting", "/v1/completions", b'{"model": "x", "metadata": ' + b"[" * 100_000 + b"]" * 100_000
         + b"}", "application/json"),
        ("lone-surrogate", chat, b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}'
         % model.encode(), "application/json"),
        ("text-plain", "/v1/completions", json.dumps(ok).encode(), "text/plain"),
        ("seed-overflow", "/v1/completions", json.dumps({**ok, "seed": 2**64, "temperature": 1}).encode(),
         "application/json"),
        ("unknown-role", chat, json.dumps({"model": model, "messages": [{"role": "tool", "content": "x"}]})
         .encode(), "application/json"),
        ("unknown-field", text, json.dumps({**ok, "frobnicate": 1}).encode(), js),
        ("body-too-large", "/v1/completions", json.dumps({**ok, "prompt": "x" * (5 * 2**20)}).encode(),
         "application/json"),
        ("other-model", text, json.dumps({**ok, "model": "nope"}).encode(), js),
        ("temperature-3", text, json.dumps({**ok, "temperature": 3}).encode(), js),
    ]


def _good_request(model: str, prompt: str, rng: random.Random,
                  max_tokens: int) -> tuple[str, str, bytes, str]:
    sampling: dict[str, Any] = rng.choice([
        {"temperature": 0}, {"temperature": 0.8, "seed": rng.randrange(2**32)}, {"temperature": 1e-300},
        {"temperature": 1.0, "top_p": 0.9}])
    if rng.random() < 0.5:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
        path = "/v1/chat/completions"
    else:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
        path = "/v1/completions"
    return "good", path, json.dumps({**body, **sampling}).encode(), "application/json"


def _post(port: int, path: str, body: bytes, content_type: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": content_type})
        response = conn.getresponse()
        response.read()
        return response.status
    except (ConnectionError, http.client.HTTPException, OSError) as exc:
        log.warning("request failed without a response: %s", exc)
        return 0
    finally:
        conn.close()


def _get_json(port: int, path: str) -> dict[str, Any] | None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return json.loads(response.read()) if response.status == 200 else None
    except (ConnectionError, http.client.HTTPException, OSError, json.JSONDecodeError):
        return None
    finally:
        conn.close()


def rss_mb(pid: int) -> float:
    """Resident memory of process `pid` in MiB (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_idle(port: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = _get_json(port, "/health")
        if health and health["running"] == 0 and health["queue_depth"] == 0:
            return
        time.sleep(0.2)
    raise RuntimeError("the server did not become idle")


def run(args: argparse.Namespace) -> int:
    refuse_counts("soak", args, positive=("bursts", "concurrency", "max_tokens"))
    if not 0.0 <= args.bad_share <= 1.0:
        raise SystemExit(f"moeinf bench soak: error: --bad-share must lie in [0, 1], got {args.bad_share}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    label = args.model or "zoo full (shipped)"
    if args.model is None:
        from moeinf.zoo import get_model

        args.model = str(get_model("full"))
    name = "soak-model"
    port = _free_port()
    command = [sys.executable, "-m", "moeinf", "serve", args.model, "--port", str(port), "--model-name", name,
               "--max-queue", str(4 * args.concurrency), *args.server_arg,
               *(["--no-memory-trim"] if args.no_memory_trim else [])]
    env = {k: v for k, v in os.environ.items() if k != "MOEINF_API_KEY"}
    server_log = Path(args.out) / "server.log" if args.out else Path(os.devnull)
    server_log.parent.mkdir(parents=True, exist_ok=True)
    log.info("starting: %s (its log: %s)", " ".join(command), server_log)
    with open(server_log, "wb") as sink:
        server = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
    rng = random.Random(args.seed)
    prompts = _prompts()
    bad_kinds = _bad_requests(name)
    results: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + args.startup_timeout
        while _get_json(port, "/health") is None:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start (exit status {server.poll()})")
            time.sleep(1)
        log.info("server up; RSS %.0f MiB", rss_mb(server.pid))
        results.append({"burst": 0, "rss_mb": round(rss_mb(server.pid), 1)})
        n_bad = round(args.concurrency * args.bad_share)
        bad_index = 0
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            for burst in range(1, args.bursts + 1):
                requests = [_good_request(name, rng.choice(prompts), rng, args.max_tokens)
                            for _ in range(args.concurrency - n_bad)]
                for _ in range(n_bad):
                    requests.append(bad_kinds[bad_index % len(bad_kinds)])
                    bad_index += 1
                rng.shuffle(requests)
                start = time.monotonic()
                statuses = list(pool.map(lambda r: (r[0], _post(port, r[1], r[2], r[3])), requests))
                wall = time.monotonic() - start
                _wait_idle(port)
                time.sleep(1.5)  # the idle trim runs within a second of becoming idle
                good = [s for kind, s in statuses if kind == "good"]
                bad = [(kind, s) for kind, s in statuses if kind != "good"]
                row = {
                    "burst": burst, "rss_mb": round(rss_mb(server.pid), 1), "wall_s": round(wall, 2),
                    "good": len(good), "good_200": sum(s == 200 for s in good),
                    "bad": len(bad), "bad_4xx": sum(400 <= s < 500 for _, s in bad),
                    "unexpected": sorted({f"{kind}:{s}" for kind, s in statuses
                                          if (kind == "good") != (s == 200) or (kind != "good" and
                                                                               not 400 <= s < 500)}),
                }
                results.append(row)
                log.info("burst %d: RSS %.0f MiB, good %d/%d 200, bad %d/%d 4xx, %.1f s%s", burst,
                         row["rss_mb"], row["good_200"], row["good"], row["bad_4xx"], row["bad"], wall,
                         f", unexpected {row['unexpected']}" if row["unexpected"] else "")
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    bursts = [r for r in results if r["burst"] > 0]
    reference = next((r["rss_mb"] for r in bursts if r["burst"] == BASELINE_BURST), None)
    summary = {
        "bursts": len(bursts), "concurrency": args.concurrency, "bad_share": args.bad_share,
        "rss_start_mb": results[0]["rss_mb"], f"rss_after_{BASELINE_BURST}_mb": reference,
        "rss_last_mb": bursts[-1]["rss_mb"] if bursts else None,
        "rss_last_vs_reference": round(bursts[-1]["rss_mb"] / reference, 3) if reference else None,
        "all_good_200": all(r["good_200"] == r["good"] for r in bursts),
        "all_bad_4xx": all(r["bad_4xx"] == r["bad"] for r in bursts),
    }
    header = {"bench": "soak", "model": label, "server_args": command[command.index("--port") + 2:],
              "max_tokens": args.max_tokens, "seed": args.seed, "machine": machine()}
    if args.out:
        write_jsonl(Path(args.out) / "soak.jsonl", [*results, {"summary": summary}], header)
    if args.json:
        print(json.dumps({**header, "results": results, "summary": summary}))
    else:
        for key, value in summary.items():
            print(f"{key}: {value}")
    ok = summary["all_good_200"] and summary["all_bad_4xx"]
    return 0 if ok else 1
