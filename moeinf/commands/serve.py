"""Serve a MoE model over an OpenAI-compatible HTTP API, with a chat page at http://HOST:PORT/.

Endpoints: / (chat page), /v1/models, /v1/completions, /v1/chat/completions (streamed or not),
/health, /metrics (Prometheus). Requests are batched continuously by default: a new request is
prefilled and joins the running batch at the next decode step, and a finished one leaves at once;
--batching static gathers up to --max-batch requests (or what arrived within --max-wait-s of the
first) and decodes them together to the end, as in the MoE-Infinity paper. --max-batch defaults to 64
rows with continuous batching and 16 with static batching (rows that leave as they finish make a larger
batch pay: see `moeinf.serve.batcher.MAX_BATCH`). Each sequence keeps its
own expert activation matrix. The server binds 127.0.0.1 unless --host says otherwise; a key read from
--api-key-file or $MOEINF_API_KEY requires `Authorization: Bearer <key>`. Only JSON POSTs from this
server's own host names are accepted (--allow-host, --cors-origin open more); bodies and prompts are
capped (--max-body-bytes, --max-prompt-chars). Ctrl-C ends open streams and stops.

  moeinf serve path/to/model --device-cache 25% --port 8000
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys

from moeinf.commands import options
from moeinf.serve.batcher import (
    BATCHING,
    JOIN_HOLD_TOKENS,
    JOIN_MIN_ROWS,
    JOIN_WAIT_S,
    MAX_BATCH,
    PREFILL_PADDING,
)
from moeinf.serve.protocol import MAX_BODY_BYTES, PROMPT_CHARS_PER_TOKEN

log = logging.getLogger(__name__)

API_KEY_ENV = "MOEINF_API_KEY"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
WILDCARD = ("0.0.0.0", "::", "")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_model_argument(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    parser.add_argument("--port", type=port, default=8000, help="TCP port (checked before the model loads)")
    group = parser.add_argument_group("access")
    group.add_argument(
        "--api-key-file",
        metavar="PATH",
        default=None,
        help=f"require the bearer key written in this file (its first line); else ${API_KEY_ENV} when set; "
        "neither = no key (open to whoever can reach the port)",
    )
    group.add_argument(
        "--api-key",
        default=None,
        help="the key itself (deprecated: visible to every user in `ps`; use --api-key-file or "
        f"${API_KEY_ENV})",
    )
    group.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also accept requests whose Host header names NAME (repeatable; '*' any host). By default only "
        "the bound address and, on a loopback address, localhost/127.0.0.1/::1 (defeats DNS rebinding)",
    )
    group.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        type=origin,
        metavar="ORIGIN",
        help="let web pages of ORIGIN (e.g. http://localhost:3000; '*' any) call the API from a browser "
        "(repeatable; default: none, CORS closed)",
    )
    group.add_argument(
        "--max-body-bytes",
        type=options.positive_int,
        default=MAX_BODY_BYTES,
        help="largest request body accepted (413 above it, before it is read)",
    )
    group.add_argument(
        "--max-prompt-chars",
        type=options.positive_int,
        default=None,
        help=f"longest prompt in characters, refused before tokenising (default: {PROMPT_CHARS_PER_TOKEN} "
        "per token of the model's context window)",
    )
    parser.add_argument(
        "--model-name", default=None, type=options.model_name,
        help="the model id clients send (default: MODEL as named: demo, org/name or the directory's name)"
    )
    add_batching_arguments(parser)
    parser.add_argument(
        "--max-queue", type=options.positive_int, default=64, help="waiting requests before answering 429"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=options.positive_int,
        default=options.DEFAULT_MAX_NEW_TOKENS,
        help="answer length of requests that give no max_tokens (capped by the context window)",
    )
    parser.add_argument(
        "--default-max-tokens", dest="max_new_tokens", type=options.positive_int, help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--no-memory-trim",
        action="store_true",
        help="keep freed memory in the allocator when idle instead of returning it to the system "
        "(malloc_trim after each burst; see moeinf.serve.memory)",
    )
    options.add_offload_arguments(parser, no_offload=True)
    options.add_threads_argument(parser)


def add_batching_arguments(parser: argparse.ArgumentParser, *, compare: bool = False) -> None:
    """--batching, --max-batch, --max-wait-s and the continuous scheduler's knobs (--join-wait-s,
    --join-hold-tokens, --join-min-rows, --prefill-padding): shared by serve and replay (`compare`:
    several schedulers)."""
    group = parser.add_argument_group("batching")
    group.add_argument(
        "--batching",
        choices=BATCHING,
        nargs="+" if compare else None,
        default=["continuous"] if compare else "continuous",
        help=("schedulers to replay, each at every rate; " if compare else "")
        + "continuous: requests join and leave the running batch between decode steps; "
        "static: a gathered batch decodes to its end before the next starts",
    )
    group.add_argument(
        "--max-batch",
        type=options.positive_int,
        default=None,
        help=f"sequences decoded together (default: {MAX_BATCH['continuous']} with continuous batching, "
        f"whose rows leave as they finish, {MAX_BATCH['static']} with static batching; each running row "
        "keeps a KV cache)",
    )
    group.add_argument(
        "--max-wait-s",
        type=options.non_negative_float,
        default=1.0,
        help="static batching: longest wait for a batch to fill after its first request",
    )
    group.add_argument(
        "--join-wait-s",
        type=options.non_negative_float,
        default=JOIN_WAIT_S,
        help="continuous batching: longest a request waits to join the running rows together with later "
        "arrivals (one prefill pass for all of them); 0 = join at the next step",
    )
    group.add_argument(
        "--join-hold-tokens",
        type=options.positive_int,
        default=JOIN_HOLD_TOKENS,
        help="continuous batching: held arrivals join at once when their prompts hold this many tokens "
        "together (a pass that long shares nothing more by waiting)",
    )
    group.add_argument(
        "--join-min-rows",
        type=options.positive_int,
        default=JOIN_MIN_ROWS,
        help="continuous batching with the batch full and requests queueing: refill freed rows once this "
        "many are free, so that a burst joins several per prefill pass; 1 = refill one by one",
    )
    group.add_argument(
        "--prefill-padding",
        type=padding_ratio,
        default=PREFILL_PADDING,
        help="continuous batching: arrivals joining together are prefilled shortest first, in passes whose "
        "padded tokens (rows x longest prompt) are at most this many times their real tokens; "
        "1 = only prompts of equal length share a pass",
    )


def padding_ratio(text: str) -> float:
    value = options.non_negative_float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (padded tokens per real token), got {text}")
    return value


def origin(text: str) -> str:
    """A web origin as browsers send it (scheme://host[:port], no path), or '*': anything else would never
    match a request's Origin header, and CORS would stay closed without a word."""
    from urllib.parse import urlsplit

    if text == "*":
        return text
    parts = urlsplit(text)
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number or out of range)
    except ValueError:
        parts = urlsplit("")
    if not parts.scheme or not parts.hostname or parts.path or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"{text!r} is not an origin: give scheme://host[:port] such as "
                                         "'http://localhost:3000' (no path, no trailing slash), or '*'")
    return text


def port(text: str) -> int:
    value = options.positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (1-65535), got {value}")
    return value


def bind(host: str, port_number: int) -> socket.socket:
    """The listening socket, bound before the model loads so a taken port fails in a second."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port_number))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise options.UsageError(
                f"port {port_number} on {host} is in use (another server?); choose another with --port"
            ) from None
        raise options.UsageError(
            f"cannot listen on {host}:{port_number}: {exc.strerror}; check --host"
        ) from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def api_key(args: argparse.Namespace) -> str | None:
    """The bearer key: --api-key (with a warning), --api-key-file, or $MOEINF_API_KEY; None = open."""
    if args.api_key is not None and args.api_key_file is not None:
        raise options.UsageError("give the key once: --api-key-file or --api-key, not both")
    if args.api_key is not None:
        log.warning("--api-key shows the key to every user of this machine (ps); put it in a file for "
                    "--api-key-file or in $%s", API_KEY_ENV)
        key = args.api_key
    elif args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise options.UsageError(f"cannot read --api-key-file {args.api_key_file}: {exc}") from None
        if not key:
            raise options.UsageError(f"--api-key-file {args.api_key_file} is empty; write the key on its "
                                     "first line")
    else:
        key = os.environ.get(API_KEY_ENV) or None
    return key


def allowed_hosts(args: argparse.Namespace) -> list[str] | None:
    """Host names requests may address: the bound one (and the loopback names on a loopback address)
    plus --allow-host; None (any) for a wildcard bind without --allow-host, whose names are unknown."""
    extra = list(args.allow_host)
    if "*" in extra:
        return None
    if args.host in WILDCARD:
        if not extra:
            log.warning("bound to every address (%s) without --allow-host: the Host header is not checked",
                        args.host or "*")
            return None
        return extra
    names = [args.host, *extra]
    if args.host in LOOPBACK or args.host.startswith("127."):
        names += LOOPBACK
    return names


def run(args: argparse.Namespace) -> int:
    from moeinf.serve.app import create_app, run_server
    from moeinf.serve.loader import load_backend

    key = api_key(args)
    hosts = allowed_hosts(args)
    sock = bind(args.host, args.port)
    config = None if args.no_offload else options.offload_config(args, args.model_dir)
    if config is not None:
        options.ensure_store(args.model_dir, config, progress=True)
    ref = getattr(args.model_dir, "ref", None)
    backend = load_backend(args.model_dir, config, name=args.model_name or (ref.name if ref else None))
    app = create_app(
        backend,
        max_batch=args.max_batch,
        max_wait_s=args.max_wait_s,
        max_queue=args.max_queue,
        api_key=key,
        default_max_tokens=args.max_new_tokens,
        batching=args.batching,
        join_wait_s=args.join_wait_s,
        join_hold_tokens=args.join_hold_tokens,
        join_min_rows=args.join_min_rows,
        prefill_padding=args.prefill_padding,
        max_body_bytes=args.max_body_bytes,
        max_prompt_chars=args.max_prompt_chars,
        allowed_hosts=hosts,
        cors_origins=args.cors_origin,
        trim_idle=not args.no_memory_trim,
    )
    if args.host not in LOOPBACK and not key:
        log.warning(
            "serving on %s without --api-key: anyone who can reach the port can use the model", args.host
        )
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"serving {backend.name} at http://{host}:{args.port}/ (chat page; Ctrl-C stops)", file=sys.stderr)
    try:
        run_server(app, sock)
    finally:
        sock.close()
        backend.close()
    return 0
