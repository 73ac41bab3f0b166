"""Server metrics in the Prometheus text format, through `prometheus_client`.

Each `ServerMetrics` owns its own `CollectorRegistry` (several apps in one process, as in the tests,
do not share counters). Counters and histograms are updated from the model thread and the handlers;
prometheus_client makes every update thread-safe. Runtime counters (expert cache hits, misses, stall
seconds...) come from `Backend.stats()` at scrape time, through a collector, exported as gauges named
`moeinf_runtime_<key>`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _metric_name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


class RuntimeCollector(Collector):
    """The offloading runtime's counters, read from `stats_fn` at every scrape."""

    def __init__(self, stats_fn: Callable[[], dict[str, object]]):
        self._stats_fn = stats_fn

    def collect(self) -> Iterator[GaugeMetricFamily]:
        flat: dict[str, object] = {}
        for key, value in self._stats_fn().items():
            if isinstance(value, dict):
                flat.update({f"{key}_{sub}": v for sub, v in value.items()})
            else:
                flat[key] = value
        for key, value in sorted(flat.items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            yield GaugeMetricFamily(
                f"moeinf_runtime_{_metric_name(key)}",
                f"Runtime counter {key} from the offloading runtime.",
                value=float(value),
            )


class ServerMetrics:
    """Request, token, latency and load metrics of one server."""

    def __init__(self, stats_fn: Callable[[], dict[str, object]] | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "moeinf_requests", "Requests by endpoint and outcome.", ["endpoint", "outcome"], registry=r
        )
        self.prompt_tokens = Counter("moeinf_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.completion_tokens = Counter("moeinf_generation_tokens", "Tokens generated.", registry=r)
        buckets = LATENCY_BUCKETS
        self.ttft = Histogram(
            "moeinf_time_to_first_token_seconds", "Arrival to first token.", buckets=buckets, registry=r
        )
        self.tpot = Histogram(
            "moeinf_time_per_output_token_seconds", "Mean gap between output tokens.", buckets=buckets,
            registry=r,
        )
        self.e2e = Histogram(
            "moeinf_request_latency_seconds", "Arrival to last token.", buckets=buckets, registry=r
        )
        self.queue_depth = Gauge("moeinf_queue_depth", "Requests waiting for a batch.", registry=r)
        self.running = Gauge("moeinf_running_sequences", "Sequences in the running batch.", registry=r)
        if stats_fn is not None:
            r.register(RuntimeCollector(stats_fn))

    def count_request(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()

    def observe_finished(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        ttft_s: float | None,
        tpot_s: float | None,
        e2e_s: float,
    ) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        self.e2e.observe(e2e_s)

    def set_load(self, queue_depth: int, running: int) -> None:
        self.queue_depth.set(queue_depth)
        self.running.set(running)

    def render(self) -> str:
        """The exposition text served at GET /metrics."""
        return generate_latest(self.registry).decode()
