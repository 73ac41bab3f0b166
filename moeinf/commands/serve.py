"""Serve a MoE model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions).

Requests are batched as in the MoE-Infinity paper: up to --max-batch sequences, or whatever arrived
within --max-wait-s of the first one, are decoded together; each keeps its own expert activation
matrix. The server binds 127.0.0.1 unless --host says otherwise; --api-key (or MOEINF_API_KEY)
requires `Authorization: Bearer <key>`.

  moeinf serve path/to/model --device-cache 25% --prefetch activation-aware --eviction activation-aware
"""

from __future__ import annotations

import argparse
import logging
import os

from moeinf.serve.loader import add_offload_arguments, load_backend, offload_config

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="HuggingFace checkpoint directory")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, local only)"
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("MOEINF_API_KEY"),
        help="require this bearer key (default: $MOEINF_API_KEY; none = open)",
    )
    parser.add_argument(
        "--model-name", default=None, help="the model id clients send (default: MODEL_DIR's name)"
    )
    parser.add_argument("--max-batch", type=int, default=16, help="sequences decoded together")
    parser.add_argument(
        "--max-wait-s",
        type=float,
        default=1.0,
        help="longest wait for a batch to fill after its first request",
    )
    parser.add_argument("--max-queue", type=int, default=64, help="waiting requests before answering 429")
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=256,
        help="max_tokens of requests that give none (capped by the context window)",
    )
    add_offload_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from moeinf.serve.app import create_app

    config = None if args.no_offload else offload_config(args)
    backend = load_backend(args.model_dir, config, name=args.model_name)
    app = create_app(
        backend,
        max_batch=args.max_batch,
        max_wait_s=args.max_wait_s,
        max_queue=args.max_queue,
        api_key=args.api_key,
        default_max_tokens=args.default_max_tokens,
    )
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning(
            "serving on %s without --api-key: anyone who can reach the port can use the model", args.host
        )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        backend.close()
    return 0
