"""``mm-serve serve --otlp-traces-endpoint``: a real server exports one span per request over
OTLP/HTTP to a collector (a local HTTP server here, decoding what it receives with
opentelemetry-proto), with the latencies as attributes and the caller's ``traceparent`` as
its parent."""

from __future__ import annotations

import http.server
import os
import threading
import time

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
)

from tests.fixtures.server import (  # noqa: E402
    VLM_MAX_MODEL_LEN,
    VLM_SERVED_NAME,
    image_question,
    noise_png_url,
    serve_checked,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


class Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP trace collector: keeps every span it receives."""

    spans: list = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        for resource in ExportTraceServiceRequest.FromString(body).resource_spans:
            for scope in resource.scope_spans:
                Collector.spans.extend(scope.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def collector():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    server.shutdown()


@pytest.fixture(scope="module")
def traced_server(vlm_path, collector):
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # export within 0.1 s (the SDK's variable)
    args = ["--max-model-len", str(VLM_MAX_MODEL_LEN), "--served-model-name", VLM_SERVED_NAME]
    try:
        yield from serve_checked(vlm_path, [*args, "--otlp-traces-endpoint", collector])
    finally:
        del os.environ["OTEL_BSP_SCHEDULE_DELAY"]


def attributes(span) -> dict:
    values = {}
    for item in span.attributes:
        value = item.value
        values[item.key] = getattr(value, value.WhichOneof("value"))
    return values


def test_one_span_per_request_with_its_latencies_and_parent(traced_server):
    body = {
        "model": VLM_SERVED_NAME,
        "messages": image_question(noise_png_url(3, 56, 56)),
        "max_tokens": 5,
        "temperature": 0,
    }
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"}
    with httpx.Client(base_url=traced_server.url, timeout=60) as client:
        traced = client.post("/v1/chat/completions", json=body, headers=headers).json()
        plain = client.post("/v1/completions", json={**body, "messages": None, "prompt": "Hi"})
    assert plain.status_code == 200
    deadline = time.monotonic() + 10
    while len(Collector.spans) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    spans = {attributes(s)["gen_ai.request.id"]: s for s in Collector.spans}
    plain_id = f"{plain.json()['id']}-0"  # a completions request's first prompt
    assert len(Collector.spans) == 2 and set(spans) == {traced["id"], plain_id}
    span = spans[traced["id"]]
    assert span.name == "llm_request"
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN_ID
    assert spans[plain_id].trace_id.hex() != TRACE_ID  # a trace of its own
    values = attributes(span)
    assert values["gen_ai.usage.prompt_tokens"] == traced["usage"]["prompt_tokens"]
    assert values["gen_ai.usage.completion_tokens"] == 5
    assert values["gen_ai.response.finish_reason"] == "length"
    queue, ttft = (
        values["gen_ai.latency.time_in_queue"],
        values["gen_ai.latency.time_to_first_token"],
    )
    assert 0 < queue < ttft <= values["gen_ai.latency.e2e"]
    assert values["gen_ai.latency.time_in_model_prefill"] > 0
    assert values["gen_ai.latency.time_in_model_decode"] > 0
    duration = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9
    assert duration == pytest.approx(values["gen_ai.latency.e2e"], abs=0.01)


def test_without_the_flag_the_server_imports_no_tracing():
    import subprocess
    import sys

    code = (
        "import sys, mm_serve.entrypoints.openai.api_server, mm_serve.entrypoints.cli; "
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', "
        "'opentelemetry.exporter', 'mm_serve.entrypoints.openai.tracing'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
