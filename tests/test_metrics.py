"""The server's Prometheus metrics (``GET /metrics``) against what its responses reported, and
the Grafana dashboard in ``samples/`` against the metrics a real server exposes.

One real ``mm-serve serve`` subprocess (a tiny Qwen2-VL) is shared by the module; each test
compares the metrics before and after its own requests.
"""

from __future__ import annotations

import base64
import io
import json
import re
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from mm_serve.entrypoints.openai.metrics import ServerMetrics
from mm_serve.messages.outputs import EngineCoreOutput
from mm_serve.messages.stats import (
    ITERATION_TOKENS_BUCKETS,
    EngineStats,
    IterationTokens,
    RequestStats,
    RequestTimes,
)
from tests.fixtures.server import serve_checked
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

MODEL = "tiny-vlm"
ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "samples" / "grafana_dashboard.json"
# Histograms observed once per completion that finished with "stop" or "length".
PER_COMPLETION = [
    f"mm_serve_{name}_count"
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    )
]


def png_url(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (60, 80, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def user(*parts: str) -> list[dict]:
    """One user message; a part starting with ``data:`` is an image."""
    content = [
        {"type": "image_url", "image_url": {"url": p}}
        if p.startswith("data:")
        else {"type": "text", "text": p}
        for p in parts
    ]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", seed=5)
    args = ["--max-model-len", "512", "--num-kv-blocks", "128", "--served-model-name", MODEL]
    yield from serve_checked(path, args)


def metric_families(server) -> list:
    """The metric families of ``/metrics``, parsed."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return list(text_string_to_metric_families(text))


def scrape(server) -> dict[str, float]:
    """``/metrics`` as {sample: value}: ``name`` or ``name{label="value",...}``."""
    values = {}
    for family in metric_families(server):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


def chat(server, messages: list[dict], **fields) -> dict:
    body = {"model": MODEL, "messages": messages, "temperature": 0, **fields}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_request_stats_phases_and_itl() -> None:
    """Queue, prefill, decode and inference time come from the engine's timestamps; TTFT and
    the ITLs from the front end's arrival times."""
    times = RequestTimes()
    outputs = [  # (output, when it reached the front end)
        (EngineCoreOutput("r", [], scheduled_time=10.5, timestamp=10.7), 10.8),  # prompt chunk
        (EngineCoreOutput("r", [1], timestamp=11.0), 11.25),
        (EngineCoreOutput("r", [2], timestamp=11.5), 11.75),
        (EngineCoreOutput("r", [3], finish_reason="length", timestamp=12.0), 12.5),
    ]
    assert [times.record(output, now) for output, now in outputs] == [None, None, 0.5, 0.75]
    stats = RequestStats(0, "length", 7, 3, arrival_time=10.0, finished_time=12.5, times=times)
    assert (stats.queue_time, stats.prefill_time) == (0.5, 0.5)
    assert (stats.decode_time, stats.inference_time) == (1.0, 1.5)
    assert (stats.ttft, stats.tpot, stats.e2e_latency) == (1.25, 0.625, 2.5)
    assert RequestStats(0, "abort", 7, 0, 10.0, 10.1).prefill_time is None


def test_iteration_tokens_histogram() -> None:
    """Bucket ``le`` counts a step of exactly that many tokens; +Inf holds the rest."""
    histogram = IterationTokens()
    assert histogram.add_to(EngineStats()) == EngineStats()  # no step yet
    for num_tokens in (1, 2, 8, 9, ITERATION_TOKENS_BUCKETS[-1] + 1):
        histogram.observe(num_tokens)
    metrics = ServerMetrics()
    text = metrics.render(histogram.add_to(EngineStats())).decode()
    assert 'mm_serve_iteration_tokens_total_bucket{le="1.0"} 1.0' in text
    assert 'mm_serve_iteration_tokens_total_bucket{le="8.0"} 3.0' in text
    assert 'mm_serve_iteration_tokens_total_bucket{le="16.0"} 4.0' in text
    assert 'mm_serve_iteration_tokens_total_bucket{le="+Inf"} 5.0' in text
    assert f"mm_serve_iteration_tokens_total_sum {21 + ITERATION_TOKENS_BUCKETS[-1]}.0" in text


def test_counters_and_histograms_match_the_responses(server) -> None:
    """A length-limited request and an ``n=2`` request ended by a stop string: each
    completion is counted by finish reason and observed once by each per-completion
    histogram; the token counters equal the usage the responses reported."""
    messages = user(png_url(1), "Describe the picture.")
    before = scrape(server)
    plain = chat(server, messages, max_tokens=8, ignore_eos=True, return_token_ids=True)
    text = plain["choices"][0]["message"]["content"]
    stop = text[len(text) // 2 :][:2]
    assert stop, text
    stopped = chat(server, messages, max_tokens=8, n=2, stop=[stop], return_token_ids=True)
    after = scrape(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    replies = [plain, stopped]
    choices = [c for r in replies for c in r["choices"]]
    tokens = [len(c["token_ids"]) for c in choices]
    reasons = Counter(c["finish_reason"] for c in choices)
    assert reasons["length"] >= 1 and reasons["stop"] >= 1, reasons
    for reason in ("stop", "length", "abort", "error"):
        name = f'mm_serve_request_success_total{{finished_reason="{reason}"}}'
        assert delta(name) == reasons[reason], reason
    completion_tokens = sum(r["usage"]["completion_tokens"] for r in replies)
    assert delta("mm_serve_generation_tokens_total") == completion_tokens == sum(tokens)
    prompt_tokens = [r["usage"]["prompt_tokens"] for r in replies]
    assert delta("mm_serve_prompt_tokens_total") == sum(prompt_tokens)
    for name in PER_COMPLETION:
        assert delta(name) == len(choices), name
    assert delta("mm_serve_time_per_output_token_seconds_count") == sum(t >= 2 for t in tokens)
    assert delta("mm_serve_inter_token_latency_seconds_count") == sum(t - 1 for t in tokens)
    assert delta("mm_serve_request_generation_tokens_sum") == sum(tokens)
    per_choice_prompt = prompt_tokens[0] + 2 * prompt_tokens[1]
    assert delta("mm_serve_request_prompt_tokens_sum") == per_choice_prompt
    # The phases, from the engine's timestamps, add up within TTFT and e2e.
    queue, prefill, decode, inference, ttft, e2e = (
        delta(f"mm_serve_{name}_sum")
        for name in (
            "request_queue_time_seconds",
            "request_prefill_time_seconds",
            "request_decode_time_seconds",
            "request_inference_time_seconds",
            "time_to_first_token_seconds",
            "e2e_request_latency_seconds",
        )
    )
    assert queue > 0 and prefill > 0 and decode > 0
    assert queue + prefill <= ttft and queue + inference <= e2e
    assert inference == pytest.approx(prefill + decode)
    assert delta("mm_serve_iteration_tokens_total_count") >= max(tokens)
    assert delta("mm_serve_iteration_tokens_total_sum") >= sum(tokens)
    assert after["mm_serve_num_requests_running"] == after["mm_serve_num_requests_waiting"] == 0


def test_aborted_request_is_counted_but_not_timed(server) -> None:
    """A stream closed after its first chunk: one "abort", no latency observation."""
    before = scrape(server)
    body = {"model": MODEL, "messages": user("Count."), "max_tokens": 400, "ignore_eos": True}
    url = f"{server.url}/v1/chat/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
        next(response.iter_lines())
    aborted = 'mm_serve_request_success_total{finished_reason="abort"}'
    deadline = time.monotonic() + 10
    while (after := scrape(server)).get(aborted, 0.0) == before.get(aborted, 0.0):
        assert time.monotonic() < deadline, "the abort was not counted"
        time.sleep(0.1)
    assert after[aborted] - before.get(aborted, 0.0) == 1
    for name in PER_COMPLETION:
        assert after[name] == before[name], name
    assert after["mm_serve_generation_tokens_total"] > before["mm_serve_generation_tokens_total"]


def test_cache_hit_counters(server) -> None:
    """The same image thrice: the processor cache hits twice; text before it the second time
    keeps the prefix cache off the image, so the encoder cache hits; the first request again
    hits the prefix cache."""
    image = png_url(2)
    before = scrape(server)
    first = user(image, "What is this?")
    chat(server, first, max_tokens=2)
    chat(server, user("First this.", image), max_tokens=2)
    again = chat(server, first, max_tokens=2)
    after = scrape(server)

    def delta(name: str) -> float:
        return after[f"mm_serve_{name}_total"] - before[f"mm_serve_{name}_total"]

    assert (delta("processor_cache_queries"), delta("processor_cache_hits")) == (3, 2)
    assert 1 <= delta("encoder_cache_hits") <= delta("encoder_cache_queries") <= 3
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert cached <= delta("prefix_cache_hits") <= delta("prefix_cache_queries")


def dashboard_metric_names() -> set[str]:
    """Every metric name in the PromQL of the dashboard's panels."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs, "the dashboard has no queries"
    return {name for expr in exprs for name in re.findall(r"\bmm_serve_\w+", expr)}


def test_dashboard_uses_only_exposed_metrics(server) -> None:
    """Each metric a dashboard query names is in a real server's ``/metrics`` (after a
    request, so that labelled counters have samples); panels use the ``DS_PROMETHEUS``
    datasource variable; the README lists every metric family."""
    chat(server, user("Hello."), max_tokens=2)
    families = metric_families(server)
    exposed = {sample.name for family in families for sample in family.samples}
    dashboard = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
    missing = dashboard_metric_names() - exposed
    assert not missing, f"the dashboard queries metrics the server lacks: {sorted(missing)}"
    readme = (ROOT / "README.md").read_text()
    names = {f.name for f in families if not f.name.endswith("_created")}  # creation times
    undocumented = {name for name in names if name not in readme}
    assert not undocumented, f"the README does not list {sorted(undocumented)}"
