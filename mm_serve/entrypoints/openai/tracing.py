"""OpenTelemetry traces of the served requests (``--otlp-traces-endpoint``), as vLLM exports
them: one span per finished completion, sent over OTLP/HTTP by the OpenTelemetry SDK.

A request's span is named ``llm_request`` and runs from the request's arrival to its end; its
parent is the caller's span when the HTTP request carries a W3C ``traceparent`` header
(``TraceContext``, an ASGI middleware, makes it the request's current context). Attributes
(seconds for the latencies; a milestone not reached is left out):

- ``gen_ai.request.id``, ``gen_ai.response.finish_reason``, ``mm_serve.completion_index``;
- ``gen_ai.usage.prompt_tokens``, ``gen_ai.usage.completion_tokens``;
- ``gen_ai.latency.time_in_queue`` (arrival to first scheduled: preprocessing included),
  ``gen_ai.latency.time_to_first_token``, ``gen_ai.latency.e2e``,
  ``gen_ai.latency.time_in_model_prefill`` (first scheduled to the first token, the vision
  encoder included), ``gen_ai.latency.time_in_model_decode``,
  ``gen_ai.latency.time_in_model_inference``.

Off by default: without the flag nothing here is imported and no request pays for it. With it,
the ``opentelemetry-sdk`` and ``opentelemetry-exporter-otlp-proto-http`` packages are needed
(``pip install 'mm_serve[otel]'``); the SDK's ``OTEL_*`` environment variables apply.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import context, propagate, trace
from starlette.types import ASGIApp, Receive, Scope, Send

from mm_serve.messages.stats import RequestStats

LATENCIES = {
    "gen_ai.latency.time_in_queue": "queue_time",
    "gen_ai.latency.time_to_first_token": "ttft",
    "gen_ai.latency.e2e": "e2e_latency",
    "gen_ai.latency.time_in_model_prefill": "prefill_time",
    "gen_ai.latency.time_in_model_decode": "decode_time",
    "gen_ai.latency.time_in_model_inference": "inference_time",
}


class RequestTracer:
    """Turns each finished completion's ``RequestStats`` into a span (``record``, an
    ``on_request_finished`` callback) under the request's current context."""

    def __init__(self, span_processor: Any) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        self.provider = TracerProvider(resource=Resource.create({"service.name": "mm_serve"}))
        self.provider.add_span_processor(span_processor)
        self.tracer = self.provider.get_tracer("mm_serve")

    @classmethod
    def otlp(cls, endpoint: str) -> RequestTracer:
        """Spans batched to the OTLP/HTTP collector at ``endpoint`` (``.../v1/traces``).

        Raises:
            ValueError: the OpenTelemetry packages are not installed.
        """
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as e:
            raise ValueError(
                "--otlp-traces-endpoint needs opentelemetry-sdk and "
                "opentelemetry-exporter-otlp-proto-http: pip install 'mm_serve[otel]'."
            ) from e
        return cls(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))

    def record(self, stats: RequestStats) -> None:
        """The span of one finished completion, from its arrival to its end."""
        now_ns, now = time.time_ns(), time.monotonic()
        start_ns = now_ns - int((now - stats.arrival_time) * 1e9)
        attributes = {
            "gen_ai.request.id": stats.request_id,
            "gen_ai.response.finish_reason": stats.finish_reason,
            "mm_serve.completion_index": stats.index,
            "gen_ai.usage.prompt_tokens": stats.num_prompt_tokens,
            "gen_ai.usage.completion_tokens": stats.num_output_tokens,
        }
        for name, field in LATENCIES.items():
            value = getattr(stats, field)
            if value is not None:
                attributes[name] = value
        span = self.tracer.start_span(
            "llm_request", kind=trace.SpanKind.SERVER, start_time=start_ns, attributes=attributes
        )
        span.end(end_time=now_ns - int((now - stats.finished_time) * 1e9))

    def shutdown(self) -> None:
        """Send what is still batched, then stop."""
        self.provider.shutdown()


class TraceContext:
    """ASGI middleware: an HTTP request's W3C trace context (``traceparent``) becomes its
    current OpenTelemetry context, so that its span (``RequestTracer.record``) is the caller's
    child."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        token = context.attach(propagate.extract(headers))
        try:
            await self.app(scope, receive, send)
        finally:
            context.detach(token)
