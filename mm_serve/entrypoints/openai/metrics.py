"""Prometheus metrics of the API server (``GET /metrics``), in one registry per server.

Names follow vLLM's (``vllm:`` becomes ``mm_serve_``); ``samples/grafana_dashboard.json``
charts them. Front-end metrics are recorded as requests go: HTTP responses by endpoint and
status, completions by finish reason, prompt and generated tokens, ITL, and per completion
finished with "stop" or "length" the latency histograms (seconds): TTFT, TPOT, end-to-end,
queue, prefill, decode, inference (from the engine's timestamps).

Engine metrics are read from ``AsyncLLM.get_replica_stats()`` at each scrape: running and
waiting requests, KV- and encoder-cache usage (fractions 0..1), tokens scheduled per step (a
histogram), preemptions, encoder tokens, and the prefix- (tokens), encoder- and processor-cache
(images) query/hit counters. With data parallelism each engine metric has one sample per
replica, labelled ``engine="RANK"``; the processor cache is the front end's, unlabelled.

With several API-server processes (``--api-server-count``) the front-end metrics are
prometheus-client's multiprocess ones: each process writes its own files in the shared
``PROMETHEUS_MULTIPROC_DIR`` (set before prometheus-client is imported) and ``render`` sums
them, so that every process shows the whole server's counts; the engine's come from the one
engine core. Each process has its own processor cache: its counters are published as gauges
(same sample names) as each of its requests finishes and at each of its scrapes, and summed."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from mm_serve.messages.stats import ITERATION_TOKENS_BUCKETS, EngineStats, RequestStats

PREFIX = "mm_serve_"
# vLLM's buckets, in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# Tokens per request: 1, 2, 5, 10, 20, 50, ... up to 500000.
TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))

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
}
_FRONT_END_COUNTERS = {  # EngineStats field (the metric name too) -> help: the front end's
    "processor_cache_queries": "Images looked up in the front end's processor cache.",
    "processor_cache_hits": "Images found in the processor cache (no preprocessing).",
}
ENGINE_LABEL = "engine"  # the data-parallel replica's rank


class _EngineStatsCollector(Collector):
    """Yields the last snapshot of each replica's ``EngineStats`` given to ``render`` (nothing
    before one): unlabelled for one engine core, labelled by replica for several."""

    def __init__(self, front_end: bool) -> None:
        self.stats: list[EngineStats] = []
        self.front_end = front_end  # whether to yield the processor-cache counters

    def collect(self) -> Iterator[Metric]:
        replicas = self.stats
        if not replicas:
            return
        labels = [ENGINE_LABEL] if len(replicas) > 1 else None
        for field, (name, help_text) in _ENGINE_GAUGES.items():
            family = GaugeMetricFamily(PREFIX + name, help_text, labels=labels)
            yield _per_replica(family, replicas, field)
        for field, help_text in _ENGINE_COUNTERS.items():
            family = CounterMetricFamily(PREFIX + field, help_text, labels=labels)
            yield _per_replica(family, replicas, field)
        for field, help_text in _FRONT_END_COUNTERS.items() if self.front_end else ():
            yield CounterMetricFamily(PREFIX + field, help_text, value=getattr(replicas[0], field))
        family = HistogramMetricFamily(
            PREFIX + "iteration_tokens_total",
            "Tokens scheduled per engine step (prompt and generated tokens of the batch).",
            labels=labels,
        )
        for rank, stats in enumerate(replicas):
            buckets, total = _iteration_tokens(stats)
            family.add_metric([str(rank)] if labels else [], buckets, total)
        yield family


def _per_replica(family: Metric, replicas: list[EngineStats], field: str) -> Metric:
    """``family`` with one sample of ``field`` per replica (labelled by rank if several)."""
    for rank, stats in enumerate(replicas):
        family.add_metric([str(rank)] if len(replicas) > 1 else [], getattr(stats, field))
    return family


def _iteration_tokens(stats: EngineStats) -> tuple[list[tuple[str, float]], float]:
    """The engine's tokens-per-step histogram (vLLM's ``iteration_tokens_total``): cumulative
    buckets and the sum."""
    counts = stats.iteration_tokens_counts or [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    bounds = [*map(floatToGoString, ITERATION_TOKENS_BUCKETS), "+Inf"]
    return list(zip(bounds, itertools.accumulate(counts), strict=True)), stats.iteration_tokens_sum


class ServerMetrics:
    """The server's metrics; ``render(stats)`` gives the Prometheus text exposition.

    ``multiprocess_dir``: the ``PROMETHEUS_MULTIPROC_DIR`` that several API-server processes
    share (then ``render`` shows all of theirs), None for one process. There, set
    ``front_end_stats`` to a function giving this process's processor-cache counters (an
    ``EngineStats``).
    """

    def __init__(self, multiprocess_dir: str | None = None) -> None:
        self.registry = registry = CollectorRegistry()
        counter = functools.partial(Counter, registry=registry)
        self.http_requests = counter(
            PREFIX + "http_requests",
            "HTTP responses of the API, by endpoint and status code.",
            ["endpoint", "status"],
        )
        self.request_success = counter(
            PREFIX + "request_success",
            "Finished completions (one per choice), by finish reason: stop, length, abort "
            "(client went away) or error.",
            ["finished_reason"],
        )
        self.prompt_tokens = counter(
            PREFIX + "prompt_tokens", "Prompt tokens of the requests (image tokens included)."
        )
        self.generation_tokens = counter(PREFIX + "generation_tokens", "Generated tokens.")
        self.inter_token_latency = self._histogram(
            "inter_token_latency_seconds",
            "Inter-token latency (ITL): between two outputs of a completion that bring tokens.",
            TPOT_BUCKETS,
        )
        self._define_request_histograms()
        self._engine = _EngineStatsCollector(front_end=multiprocess_dir is None)
        self.exposition = registry
        self._front_end: dict[str, Gauge] = {}
        self.front_end_stats: Callable[[], EngineStats] | None = None
        if multiprocess_dir is not None:
            self.exposition = CollectorRegistry()
            MultiProcessCollector(self.exposition, path=multiprocess_dir)
            self._front_end = {
                field: Gauge(
                    PREFIX + field + "_total", text, registry=registry, multiprocess_mode="sum"
                )
                for field, text in _FRONT_END_COUNTERS.items()
            }
        self.exposition.register(self._engine)

    def _histogram(self, name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(PREFIX + name, help_text, buckets=buckets, registry=self.registry)

    def _define_request_histograms(self) -> None:
        """``RequestStats`` attribute -> its histogram, observed once per completion that
        finished with "stop" or "length" (unless the attribute is None)."""
        histogram = self._histogram
        self._request_histograms = {
            "num_prompt_tokens": histogram(
                "request_prompt_tokens", "Prompt tokens of a completion's request.", TOKEN_BUCKETS
            ),
            "num_output_tokens": histogram(
                "request_generation_tokens", "Tokens generated by a completion.", TOKEN_BUCKETS
            ),
            "ttft": histogram(
                "time_to_first_token_seconds",
                "Time to first token (TTFT): arrival to the first output token, in seconds.",
                TTFT_BUCKETS,
            ),
            "tpot": histogram(
                "time_per_output_token_seconds",
                "Time per output token (TPOT) after the first, in seconds.",
                TPOT_BUCKETS,
            ),
            "e2e_latency": histogram(
                "e2e_request_latency_seconds",
                "End-to-end latency of a completion, arrival to last token, in seconds.",
                E2E_BUCKETS,
            ),
            "queue_time": histogram(
                "request_queue_time_seconds",
                "Arrival to the engine's first scheduling of the completion, in seconds.",
                TTFT_BUCKETS,
            ),
            "prefill_time": histogram(
                "request_prefill_time_seconds",
                "First scheduled to the engine's first token (prefill), in seconds.",
                TTFT_BUCKETS,
            ),
            "decode_time": histogram(
                "request_decode_time_seconds",
                "The engine's first token to its last token (decode), in seconds.",
                E2E_BUCKETS,
            ),
            "inference_time": histogram(
                "request_inference_time_seconds",
                "First scheduled to the engine's last token (prefill and decode), in seconds.",
                E2E_BUCKETS,
            ),
        }

    def observe_request(self, stats: RequestStats) -> None:
        """Record one finished completion (``AsyncLLM``'s ``on_request_finished``)."""
        self.request_success.labels(stats.finish_reason).inc()
        if stats.index == 0:  # the n completions of a request share its prompt
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_output_tokens)
        if self.front_end_stats is not None:
            self._publish_front_end(self.front_end_stats())
        if stats.finish_reason in ("abort", "error"):
            return  # their latencies say nothing about the engine
        for field, histogram in self._request_histograms.items():
            value = getattr(stats, field)
            if value is not None:
                histogram.observe(value)

    def _publish_front_end(self, stats: EngineStats) -> None:
        """This process's processor-cache counters, for every process's ``render``."""
        for field, gauge in self._front_end.items():
            gauge.set(getattr(stats, field))

    def observe_inter_token_latency(self, latency: float) -> None:
        """Record one inter-token latency in seconds (``AsyncLLM``'s
        ``on_inter_token_latency``)."""
        self.inter_token_latency.observe(latency)

    def observe_response(self, endpoint: str, status: int) -> None:
        """Count one HTTP response of ``endpoint`` with ``status``."""
        self.http_requests.labels(endpoint, str(status)).inc()

    def render(self, engine_stats: EngineStats | Sequence[EngineStats] | None) -> bytes:
        """The exposition text; the engine's metrics from ``engine_stats``, one engine core's
        or each data-parallel replica's (None: the last snapshot, if any, as when the engine
        is gone)."""
        if isinstance(engine_stats, EngineStats):
            engine_stats = [engine_stats]
        if engine_stats is not None:
            self._engine.stats = list(engine_stats)
            self._publish_front_end(self._engine.stats[0])
        return generate_latest(self.exposition)
