"""``mm-serve bench serve`` (``mm_serve.benchmarks.serve``): the load generator.

Pure parts by hand: seeded Poisson/gamma arrivals, statistics on made-up timings, SSE
parsing and failure handling against ``httpx.MockTransport``. Then whole runs against a real
server subprocess with a tiny Qwen2-VL: closed loop with a concurrency cap, a finite request
rate, a wrong model name (404s counted, not raised) and an unreachable server; after each run
the server's ``/metrics`` shows no running request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from mm_serve.benchmarks import serve
from mm_serve.benchmarks.serve_metrics import (
    RequestResult,
    format_table,
    parse_percentiles,
    plot_latencies,
    summarize,
)
from tests.fixtures.server import RemoteServer, free_port, metric
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

OUTPUT_LEN = 5
SMALL = ["--image-size", "56", "56", "--input-len", "8", "--output-len", str(OUTPUT_LEN)]


# ---------------------------------------------------------------- arrivals


def test_infinite_rate_sends_all_at_once():
    assert serve.arrival_times(4, math.inf) == [0.0] * 4
    assert serve.arrival_times(0, 2.0) == []


def test_poisson_arrivals_are_seeded_with_mean_gap_one_over_rate():
    times = serve.arrival_times(20_000, request_rate=50.0, seed=7)
    assert times == serve.arrival_times(20_000, request_rate=50.0, seed=7)
    assert times != serve.arrival_times(20_000, request_rate=50.0, seed=8)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_keeps_the_rate_and_changes_the_spread(burstiness):
    gaps = np.diff(serve.arrival_times(20_000, request_rate=10.0, burstiness=burstiness))
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    # Gamma with shape k: coefficient of variation 1 / sqrt(k).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_bad_rate_raises():
    with pytest.raises(ValueError):
        serve.arrival_times(3, 0.0)
    with pytest.raises(ValueError):
        serve.arrival_times(3, 1.0, burstiness=-1)


# ---------------------------------------------------------------- statistics


def test_summarize_hand_made_timings():
    results = [
        RequestResult(True, 10, 3, ttft_s=0.1, e2e_s=0.5, itl_s=[0.2, 0.2]),
        RequestResult(True, 20, 5, ttft_s=0.3, e2e_s=1.1, itl_s=[0.1, 0.3, 0.2, 0.2]),
        RequestResult(True, 5, 1, ttft_s=0.2, e2e_s=0.2),  # 1 token: no TPOT
        RequestResult(error="HTTP 500: boom"),
    ]
    summary = summarize(results, duration_s=2.0, percentiles=[50, 100])
    assert (summary["completed"], summary["failed"]) == (3, 1)
    assert (summary["total_input_tokens"], summary["total_output_tokens"]) == (35, 9)
    assert summary["request_throughput"] == pytest.approx(1.5)
    assert summary["output_throughput"] == pytest.approx(4.5)
    assert summary["total_token_throughput"] == pytest.approx(22.0)
    assert summary["mean_ttft_ms"] == pytest.approx(200.0)
    assert summary["median_ttft_ms"] == pytest.approx(200.0)
    assert summary["std_ttft_ms"] == pytest.approx(np.std([100, 300, 200]))
    assert summary["p100_e2el_ms"] == pytest.approx(1100.0)
    # TPOT: (0.5 - 0.1) / 2 = 0.2 and (1.1 - 0.3) / 4 = 0.2.
    assert summary["mean_tpot_ms"] == pytest.approx(200.0)
    assert summary["mean_itl_ms"] == pytest.approx(200.0)  # 6 gaps pooled
    assert summary["p50_itl_ms"] == pytest.approx(200.0)
    assert summary["errors"] == ["HTTP 500: boom"]
    assert summary["output_lens"] == [3, 5, 1, 0]
    table = format_table(summary)
    assert "Successful requests:" in table and "P100 TPOT (ms):" in table
    assert "Error: HTTP 500: boom" in table


def test_summarize_with_no_success_is_all_zero():
    summary = summarize([RequestResult(error="x")], duration_s=0.0, percentiles=[99])
    assert summary["completed"] == 0 and summary["request_throughput"] == 0.0
    assert summary["p99_ttft_ms"] == 0.0 and summary["mean_itl_ms"] == 0.0


def test_parse_percentiles():
    assert parse_percentiles("50, 90,99.9") == [50.0, 90.0, 99.9]
    for bad in ("", "101", "a"):
        with pytest.raises(ValueError):
            parse_percentiles(bad)


def test_plot_is_skipped_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import raises ImportError
    assert plot_latencies([RequestResult(True, 1, 1)], str(tmp_path / "p.png")) is False
    assert not (tmp_path / "p.png").exists()


# ---------------------------------------------------------------- one request, mocked


def _sse(*events: str) -> bytes:
    return "".join(f"data: {event}\n\n" for event in events).encode()


def _send(response: httpx.Response | Exception) -> RequestResult:
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(response, Exception):
            raise response
        return response

    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await serve.send_request(client, "http://test/v1/chat/completions", b"{}", {})

    return asyncio.run(go())


def test_stream_timings_and_usage():
    def delta(**fields) -> str:
        return json.dumps({"choices": [{"index": 0, "delta": fields}]})

    role, chunk, empty = delta(role="assistant", content=""), delta(content="a"), delta(content="")
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4}})
    events = _sse(role, chunk, empty, chunk, usage, "[DONE]")
    result = _send(httpx.Response(200, content=events))
    assert result.success and result.error == ""
    assert (result.prompt_tokens, result.output_tokens) == (7, 4)
    # vLLM's rule: 3 token chunks ("a", "" without a role, "a"); neither the role chunk nor
    # the usage chunk is one.
    assert len(result.itl_s) == 2
    assert 0 <= result.ttft_s <= result.e2e_s


@pytest.mark.parametrize(
    "response, expected",
    [
        (httpx.Response(404, json={"error": {"message": "no model x"}}), "HTTP 404: no model x"),
        (
            httpx.Response(200, content=_sse('{"error": {"message": "engine died"}}', "[DONE]")),
            "Error event: engine died",
        ),
        (httpx.Response(200, content=_sse('{"choices": [{"delta": {}}]}')), "before data: [DONE]"),
        (httpx.Response(200, content=_sse("[DONE]")), "without any content chunk"),
        (httpx.Response(200, content=b"data: {not json\n\n"), "JSONDecodeError"),
        (httpx.ConnectError("refused"), "ConnectError: refused"),
    ],
)
def test_failures_are_recorded_not_raised(response, expected):
    result = _send(response)
    assert not result.success
    assert expected in result.error


# ---------------------------------------------------------------- against a real server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("bench_vlm"), "qwen2_vl", seed=5)
    lean = ["--num-kv-blocks", "64", "--mm-preprocess-workers", "1"]
    with RemoteServer(path, lean) as remote:
        yield remote


def assert_no_running_requests(server: RemoteServer, timeout_s: float = 5.0) -> None:
    """``/metrics`` shows 0 running requests (the gauge updates with the next engine step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        running = metric(text, "mm_serve_num_requests_running")
        if running == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert running == 0


def run_bench(server: RemoteServer, json_path, *flags: str) -> dict:
    """``mm-serve bench serve`` as a user runs it; returns its JSON."""
    command = [sys.executable, "-m", "mm_serve.entrypoints.cli", "bench", "serve"]
    command += ["--base-url", server.url]
    command += [*SMALL, "--output-json", str(json_path), *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Serving Benchmark Result" in done.stdout
    return json.loads(json_path.read_text())


def test_closed_loop_run_with_concurrency_cap(server, tmp_path):
    plot = tmp_path / "latencies.png"
    flags = ["--num-prompts", "8", "--max-concurrency", "3", "--ignore-eos", "--plot", str(plot)]
    result = run_bench(server, tmp_path / "result.json", *flags)
    assert (result["completed"], result["failed"]) == (8, 0)
    assert result["total_output_tokens"] == 8 * OUTPUT_LEN  # ignore_eos: exactly max_tokens
    assert result["output_lens"] == [OUTPUT_LEN] * 8
    assert all(n > 8 for n in result["input_lens"])  # text words plus image tokens
    assert all(0 < t <= e for t, e in zip(result["ttfts"], result["e2els"], strict=True))
    assert result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert result[f"p50_{name}_ms"] <= result[f"p90_{name}_ms"] <= result[f"p99_{name}_ms"]
    assert result["output_throughput"] == pytest.approx(8 * OUTPUT_LEN / result["duration_s"])
    assert result["settings"]["request_rate"] == "inf"
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert_no_running_requests(server)


def test_finite_request_rate_follows_the_arrivals(server, tmp_path):
    flags = ["--num-prompts", "5", "--request-rate", "10", "--seed", "3", "--ignore-eos"]
    result = run_bench(server, tmp_path / "result.json", *flags)
    assert (result["completed"], result["failed"]) == (5, 0)
    assert result["total_output_tokens"] == 5 * OUTPUT_LEN
    # The last request is sent at its arrival time, so the run lasts at least that long.
    assert result["duration_s"] >= serve.arrival_times(5, 10.0, seed=3)[-1]
    assert result["settings"]["request_rate"] == 10.0
    assert_no_running_requests(server)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    return parser.parse_args([*SMALL, *argv])


def test_wrong_model_counts_404s(server, capsys):
    # A trailing /v1 in --base-url is accepted, as OpenAI clients spell it.
    args = _args("--base-url", f"{server.url}/v1", "--model", "nope", "--num-prompts", "3")
    result = serve.main(args)
    assert (result["completed"], result["failed"]) == (0, 3)
    assert all(error.startswith("HTTP 404") for error in result["errors"])
    assert "Failed requests:" in capsys.readouterr().out
    assert_no_running_requests(server)


def test_unreachable_server_counts_connection_errors():
    url = f"http://127.0.0.1:{free_port()}"
    result = serve.main(_args("--base-url", url, "--model", "m", "--num-prompts", "2"))
    assert (result["completed"], result["failed"]) == (0, 2)
    assert "ConnectError" in result["errors"][0]
    with pytest.raises(serve.BenchmarkError, match="Cannot reach"):
        serve.main(_args("--base-url", url))  # no --model: GET /v1/models fails
