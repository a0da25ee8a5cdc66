"""Prometheus metrics of the API server (``GET /metrics``), in one registry per server.

Front-end metrics are recorded as requests go: HTTP responses by endpoint and status,
completions by finish reason, prompt and generated tokens, and the latency histograms (TTFT,
TPOT, e2e; seconds). Engine metrics are read from ``AsyncLLM.get_stats()`` at each scrape:
running and waiting requests, KV-cache and encoder-cache usage (fractions 0..1), and the
prefix-, encoder- and processor-cache query/hit counters (prefix cache in tokens, the others
in images), preemptions and encoder tokens computed. The hit rate is ``hits / queries``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mm_serve.stats import EngineStats, RequestStats

PREFIX = "mm_serve_"
# vLLM's buckets, in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

# EngineStats field -> (metric name, help): current values.
_ENGINE_GAUGES = {
    "num_running_reqs": ("num_requests_running", "Requests in the engine's running batch."),
    "num_waiting_reqs": ("num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_cache_usage": ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1)."),
    "encoder_cache_usage": (
        "encoder_cache_usage_perc",
        "Fraction of the encoder cache referenced by requests (0..1).",
    ),
    "num_encoder_cache_entries": ("encoder_cache_entries", "Images held by the encoder cache."),
}
_ENGINE_COUNTERS = {  # EngineStats field (the metric name too) -> help: cumulative
    "num_preemptions": "Requests preempted (their KV blocks freed).",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "encoder_cache_queries": "Images looked up in the encoder cache.",
    "encoder_cache_hits": "Images found in the encoder cache.",
    "encoder_tokens_computed": "Image embedding tokens run through the vision encoder.",
    "processor_cache_queries": "Images looked up in the front end's processor cache.",
    "processor_cache_hits": "Images found in the processor cache (no preprocessing).",
}


class _EngineStatsCollector(Collector):
    """Yields the last ``EngineStats`` snapshot given to ``update`` (nothing before one)."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        for field, (name, help_text) in _ENGINE_GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, help_text, value=getattr(stats, field))
        for field, help_text in _ENGINE_COUNTERS.items():
            yield CounterMetricFamily(PREFIX + field, help_text, value=getattr(stats, field))


class ServerMetrics:
    """The server's metrics; ``render(stats)`` gives the Prometheus text exposition."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        counter = functools.partial(Counter, registry=registry)
        histogram = functools.partial(Histogram, registry=registry)
        self.http_requests = counter(
            PREFIX + "http_requests",
            "HTTP responses of the API, by endpoint and status code.",
            ["endpoint", "status"],
        )
        self.completions = counter(
            PREFIX + "request_finished",
            "Finished completions (one per choice), by finish reason: stop, length, abort "
            "(client went away) or error.",
            ["finish_reason"],
        )
        self.prompt_tokens = counter(
            PREFIX + "prompt_tokens", "Prompt tokens of the requests (image tokens included)."
        )
        self.generation_tokens = counter(PREFIX + "generation_tokens", "Generated tokens.")
        self.ttft = histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to first token (TTFT): arrival to the first output token, in seconds.",
            buckets=TTFT_BUCKETS,
        )
        self.tpot = histogram(
            PREFIX + "time_per_output_token_seconds",
            "Time per output token (TPOT) after the first, in seconds.",
            buckets=TPOT_BUCKETS,
        )
        self.e2e = histogram(
            PREFIX + "e2e_request_latency_seconds",
            "End-to-end latency of a completion, arrival to last token, in seconds.",
            buckets=E2E_BUCKETS,
        )
        self._engine = _EngineStatsCollector()
        registry.register(self._engine)

    def observe_request(self, stats: RequestStats) -> None:
        """Record one finished completion (``AsyncLLM``'s ``on_request_finished``)."""
        self.completions.labels(stats.finish_reason).inc()
        if stats.index == 0:  # the n completions of a request share its prompt
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_output_tokens)
        if stats.finish_reason in ("abort", "error"):
            return  # their latencies say nothing about the engine
        if stats.ttft is not None:
            self.ttft.observe(stats.ttft)
        if stats.tpot is not None:
            self.tpot.observe(stats.tpot)
        self.e2e.observe(stats.e2e_latency)

    def observe_response(self, endpoint: str, status: int) -> None:
        """Count one HTTP response of ``endpoint`` with ``status``."""
        self.http_requests.labels(endpoint, str(status)).inc()

    def render(self, engine_stats: EngineStats | None) -> bytes:
        """The exposition text; the engine's metrics from ``engine_stats`` (None: the last
        snapshot, if any, as when the engine is gone)."""
        if engine_stats is not None:
            self._engine.stats = engine_stats
        return generate_latest(self.registry)
