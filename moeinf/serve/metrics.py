"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand.

Counters and histograms are updated from the batching thread and read by the /metrics handler, so
every update and the rendering hold one lock. Runtime counters (expert cache hits, misses, stall
seconds) come from `Backend.stats()` at scrape time and are exported as gauges named
`moeinf_runtime_<key>`.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Sequence

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    """Cumulative-bucket histogram with a sum and a count."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS):
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1

    def render(self, name: str) -> list[str]:
        lines = [
            f'{name}_bucket{{le="{_fmt(b)}"}} {c}' for b, c in zip(self.buckets, self.counts, strict=True)
        ]
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{name}_sum {_fmt(self.sum)}", f"{name}_count {self.count}"]
        return lines


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _metric_name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


class ServerMetrics:
    """Request, token and latency metrics of one server."""

    def __init__(self, stats_fn: Callable[[], dict[str, float]] | None = None):
        self._lock = threading.Lock()
        self._stats_fn = stats_fn
        self.requests: dict[tuple[str, str], int] = {}  # (endpoint, outcome) -> count
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.ttft = Histogram()
        self.tpot = Histogram()
        self.e2e = Histogram()
        self.queue_depth = 0
        self.running = 0

    def count_request(self, endpoint: str, outcome: str) -> None:
        with self._lock:
            self.requests[(endpoint, outcome)] = self.requests.get((endpoint, outcome), 0) + 1

    def observe_finished(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        ttft_s: float | None,
        tpot_s: float | None,
        e2e_s: float,
    ) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            if ttft_s is not None:
                self.ttft.observe(ttft_s)
            if tpot_s is not None:
                self.tpot.observe(tpot_s)
            self.e2e.observe(e2e_s)

    def set_load(self, queue_depth: int, running: int) -> None:
        with self._lock:
            self.queue_depth, self.running = queue_depth, running

    def render(self) -> str:
        """The exposition text served at GET /metrics."""
        stats = self._stats_fn() if self._stats_fn else {}
        with self._lock:
            out = [
                "# HELP moeinf_requests_total Requests by endpoint and outcome.",
                "# TYPE moeinf_requests_total counter",
            ]
            for (endpoint, outcome), n in sorted(self.requests.items()):
                out.append(f'moeinf_requests_total{{endpoint="{endpoint}",outcome="{outcome}"}} {n}')
            out += [
                "# HELP moeinf_prompt_tokens_total Prompt tokens processed.",
                "# TYPE moeinf_prompt_tokens_total counter",
                f"moeinf_prompt_tokens_total {self.prompt_tokens}",
                "# HELP moeinf_generation_tokens_total Tokens generated.",
                "# TYPE moeinf_generation_tokens_total counter",
                f"moeinf_generation_tokens_total {self.completion_tokens}",
            ]
            for name, hist, text in (
                ("moeinf_time_to_first_token_seconds", self.ttft, "Arrival to first token."),
                ("moeinf_time_per_output_token_seconds", self.tpot, "Mean gap between output tokens."),
                ("moeinf_request_latency_seconds", self.e2e, "Arrival to last token."),
            ):
                out += [f"# HELP {name} {text}", f"# TYPE {name} histogram", *hist.render(name)]
            out += [
                "# HELP moeinf_queue_depth Requests waiting for a batch.",
                "# TYPE moeinf_queue_depth gauge",
                f"moeinf_queue_depth {self.queue_depth}",
                "# HELP moeinf_running_sequences Sequences in the running batch.",
                "# TYPE moeinf_running_sequences gauge",
                f"moeinf_running_sequences {self.running}",
            ]
        flat: dict[str, object] = {}
        for key, value in stats.items():
            if isinstance(value, dict):
                flat.update({f"{key}_{sub}": v for sub, v in value.items()})
            else:
                flat[key] = value
        for key, value in sorted(flat.items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name = f"moeinf_runtime_{_metric_name(key)}"
            out += [
                f"# HELP {name} Runtime counter {key} from the offloading runtime.",
                f"# TYPE {name} gauge",
                f"{name} {_fmt(value)}",
            ]
        return "\n".join(out) + "\n"
