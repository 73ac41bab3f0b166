"""Replay a slice of the Azure LLM inference trace against a model and read the latency summary.

    python examples/replay_trace.py                        # the zoo model, 20 s of the bundled trace
    python examples/replay_trace.py path/to/checkpoint --duration 60 --out replay-out

Each trace row (arrival time, prompt length, output length) becomes a request with real prompt text;
the requests are served in-process by the same scheduler as `moeinf serve`. The output directory holds
requests.csv, latency CDF plots and summary.json / summary.md (a temporary directory unless --out).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from moeinf.cli import main as moeinf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="full",
                        help="checkpoint directory, zoo model name or HuggingFace id (default: full)")
    parser.add_argument("--duration", default="20", help="seconds of the trace to replay")
    parser.add_argument("--length-scale", default="0.05", help="shrink prompts and outputs")
    parser.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="moeinf-replay-")

    # the command line's `moeinf replay` (the bundled trace is the default --trace), called in-process
    status = moeinf(["replay", args.model, "--duration", args.duration, "--length-scale", args.length_scale,
                     "--device-cache", "50%", "--out", out])
    if status != 0:
        raise SystemExit(status)
    summary = json.loads((Path(out) / "summary.json").read_text())
    print(json.dumps(summary, indent=1)[:2000])


if __name__ == "__main__":
    main()
