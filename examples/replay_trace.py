"""Replay a slice of the Azure LLM inference trace against a model and read the latency summary.

    python examples/replay_trace.py                        # the zoo model, 20 s of the bundled trace
    python examples/replay_trace.py path/to/checkpoint --duration 60 --out replay-out

Each trace row (arrival time, prompt length, output length) becomes a request with real prompt text;
the requests are served in-process by the same scheduler as `moeinf serve`. The output directory holds
requests.csv, latency CDF plots and summary.json / summary.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moeinf.cli import main as moeinf
from moeinf.zoo import get_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", nargs="?", help="HuggingFace checkpoint directory (default: zoo model)")
    parser.add_argument("--duration", default="20", help="seconds of the trace to replay")
    parser.add_argument("--length-scale", default="0.05", help="shrink prompts and outputs")
    parser.add_argument("--out", default="replay-out", help="output directory")
    args = parser.parse_args()

    model_dir = args.model_dir or str(get_model("full"))
    # the command line's `moeinf replay` (the bundled trace is the default --trace), called in-process
    status = moeinf(["replay", "--model", model_dir, "--duration", args.duration,
                     "--length-scale", args.length_scale, "--device-cache", "50%", "--out", args.out])
    if status != 0:
        raise SystemExit(status)
    summary = json.loads((Path(args.out) / "summary.json").read_text())
    print(json.dumps(summary, indent=1)[:2000])


if __name__ == "__main__":
    main()
