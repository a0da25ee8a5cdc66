"""``mm-serve bench serve``: the load generator, run as a user runs it.

Arrivals through ``--dry-run`` (seeded Poisson and gamma schedules, nothing sent). Statistics
and the SSE handling against a scripted OpenAI-style server in this process (``ScriptedServer``:
hand-made chunk timings, usage, HTTP errors, error events, cut streams), the result checked
field by field against the per-request lists the JSON carries. Then whole runs against a real
server subprocess with a tiny Qwen2-VL: closed loop with a concurrency cap, a finite request
rate, a wrong model name (404s counted, not raised) and an unreachable server; after each run
the server's ``/metrics`` shows no running request.
"""

from __future__ import annotations

import http.server
import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from mm_serve.entrypoints import cli
from tests.fixtures.server import RemoteServer, free_port, metric
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

OUTPUT_LEN = 5
SMALL = ["--image-size", "56", "56", "--input-len", "8", "--output-len", str(OUTPUT_LEN)]


def bench_serve(*flags: str) -> int:
    """``mm-serve bench serve FLAGS`` in this process; its exit code."""
    return cli.main(["bench", "serve", *flags])


# ---------------------------------------------------------------- arrivals


def dry_run(tmp_path, *flags: str) -> list[float]:
    """The send times (s) ``bench serve --dry-run FLAGS`` writes."""
    path = tmp_path / "schedule.json"
    assert bench_serve("--dry-run", "--output-json", str(path), *flags) == 0
    return json.loads(path.read_text())["arrival_times"]


def test_infinite_rate_sends_all_at_once(tmp_path, capsys):
    assert dry_run(tmp_path, "--num-prompts", "4") == [0.0] * 4
    assert "Dry run, nothing sent: 4 requests at inf req/s" in capsys.readouterr().out


def test_poisson_arrivals_are_seeded_with_mean_gap_one_over_rate(tmp_path, capsys):
    flags = ["--num-prompts", "20000", "--request-rate", "50"]
    times = dry_run(tmp_path, *flags, "--seed", "7")
    assert times == dry_run(tmp_path, *flags, "--seed", "7")
    assert times != dry_run(tmp_path, *flags, "--seed", "8")
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    out = capsys.readouterr().out.splitlines()[0]  # seed 7's line
    assert f"mean gap {gaps.mean() * 1000:.2f} ms" in out
    assert f"coefficient of variation {gaps.std() / gaps.mean():.3f}" in out


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_keeps_the_rate_and_changes_the_spread(tmp_path, burstiness):
    flags = ["--num-prompts", "20000", "--request-rate", "10", "--burstiness", str(burstiness)]
    gaps = np.diff(dry_run(tmp_path, *flags))
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    # Gamma with shape k: coefficient of variation 1 / sqrt(k).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


@pytest.mark.parametrize("flags", [["--request-rate", "0"], ["--burstiness", "-1"]])
def test_bad_rate_is_an_error(flags):
    with pytest.raises(SystemExit, match="--request-rate and --burstiness must be > 0"):
        bench_serve("--dry-run", *flags)


# ---------------------------------------------------------------- a scripted server


def sse(*events: str | dict) -> list[str]:
    """SSE ``data:`` lines of ``events`` (dicts as JSON)."""
    return [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]


def delta(**fields) -> dict:
    return {"choices": [{"index": 0, "delta": fields}]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                     "completion_tokens": completion_tokens}}  # fmt: skip


def stream(ttft_s: float, gaps_s: list[float], prompt_tokens: int) -> tuple[int, list]:
    """A 200 stream: the first token after ``ttft_s``, one more after each of ``gaps_s``, then
    the usage and ``[DONE]``."""
    tokens = [(delay, sse(delta(content="a"))[0]) for delay in [ttft_s, *gaps_s]]
    return 200, [*tokens, (0.0, "".join(sse(usage(prompt_tokens, len(tokens)), "[DONE]")))]


def error_body(status: int, message: str) -> tuple[int, list]:
    return status, [(0.0, json.dumps({"error": {"message": message}}))]


class ScriptedServer(http.server.ThreadingHTTPServer):
    """An HTTP server on a free port that answers the n-th POST with ``script[n]``: a status
    and ``(delay_s, text)`` pieces, each written ``delay_s`` after the previous one (HTTP/1.0:
    the body ends when the connection closes)."""

    def __init__(self, script: list[tuple[int, list[tuple[float, str]]]]) -> None:
        self.script, self.lock = list(script), threading.Lock()
        super().__init__(("127.0.0.1", 0), _ScriptedHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _ScriptedHandler(http.server.BaseHTTPRequestHandler):
    server: ScriptedServer

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.lock:
            status, pieces = self.server.script.pop(0)
        self.send_response(status)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for delay_s, text in pieces:
            time.sleep(delay_s)
            self.wfile.write(text.encode())
            self.wfile.flush()

    def log_message(self, *args) -> None:  # quiet
        pass


@pytest.fixture
def scripted() -> Iterator:
    """``scripted(script)``: a running ``ScriptedServer``, shut down after the test."""
    servers = []

    def start(script: list) -> ScriptedServer:
        servers.append(ScriptedServer(script))
        threading.Thread(target=servers[-1].serve_forever, args=(0.05,), daemon=True).start()
        return servers[-1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def run_scripted(server: ScriptedServer, json_path, *flags: str) -> dict:
    """``bench serve`` against ``server``, one request at a time (so in script order)."""
    argv = ["--base-url", server.url, "--model", "m", "--max-concurrency", "1"]
    argv += [*SMALL, "--output-json", str(json_path), *flags]
    assert bench_serve(*argv) == 0
    return json.loads(json_path.read_text())


# ---------------------------------------------------------------- statistics


def test_statistics_of_hand_made_timings(scripted, tmp_path, capsys):
    """Three streams (TTFT 0.1, 0.3, 0.2 s; gaps 0.2 0.2 / 0.1 0.3 0.2 0.2 / none) and a 500:
    every figure recomputed from the per-request lists, which follow the script."""
    script = [
        stream(0.1, [0.2, 0.2], prompt_tokens=10),
        stream(0.3, [0.1, 0.3, 0.2, 0.2], prompt_tokens=20),
        stream(0.2, [], prompt_tokens=5),  # 1 token: no TPOT
        error_body(500, "boom"),
    ]
    r = run_scripted(scripted(script), tmp_path / "r.json", "--num-prompts", "4",
                     "--percentiles", "50,100")  # fmt: skip
    assert (r["completed"], r["failed"]) == (3, 1)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (35, 9)
    assert (r["input_lens"], r["output_lens"]) == ([10, 20, 5, 0], [3, 5, 1, 0])
    assert r["errors"] == ["HTTP 500: boom"] and r["percentiles"] == [50, 100]
    assert r["ttfts"][:3] == pytest.approx([0.1, 0.3, 0.2], abs=0.08)
    assert r["e2els"][:3] == pytest.approx([0.5, 1.1, 0.2], abs=0.08)
    assert [len(gaps) for gaps in r["itls"]] == [2, 4, 0, 0]
    assert r["ttfts"][3] == r["e2els"][3] == 0.0
    starts = r["start_times"]  # one at a time: each sent when the one before ended
    assert starts[0] < 0.05 and all(np.diff(starts) > 0)
    assert starts[2] >= r["e2els"][0] + r["e2els"][1]

    duration, ttfts, e2els = r["duration_s"], np.array(r["ttfts"][:3]), np.array(r["e2els"][:3])
    assert r["request_throughput"] == pytest.approx(3 / duration)
    assert r["output_throughput"] == pytest.approx(9 / duration)
    assert r["total_token_throughput"] == pytest.approx(44 / duration)
    assert r["mean_ttft_ms"] == pytest.approx(1000 * ttfts.mean())
    assert r["median_ttft_ms"] == pytest.approx(1000 * np.median(ttfts))
    assert r["std_ttft_ms"] == pytest.approx(1000 * ttfts.std())
    assert r["p100_e2el_ms"] == pytest.approx(1000 * e2els.max())
    tpots = (e2els[:2] - ttfts[:2]) / np.array([2, 4])  # (e2e - TTFT) / (tokens - 1)
    assert r["mean_tpot_ms"] == pytest.approx(1000 * tpots.mean())
    assert tpots == pytest.approx([0.2, 0.2], abs=0.04)
    itls = np.array(r["itls"][0] + r["itls"][1])  # 6 gaps pooled
    assert r["mean_itl_ms"] == pytest.approx(1000 * itls.mean())
    assert r["p50_itl_ms"] == pytest.approx(1000 * np.median(itls))
    assert r["mean_itl_ms"] == pytest.approx(200.0, abs=40)

    table = capsys.readouterr().out
    assert "Successful requests:" in table and "P100 TPOT (ms):" in table
    assert f"{'Mean TTFT (ms):':<40}{r['mean_ttft_ms']:>10.2f}" in table
    assert "Error: HTTP 500: boom" in table


def test_percentiles_flag(scripted, tmp_path):
    server = scripted([stream(0.0, [0.01], 3)])
    r = run_scripted(
        server, tmp_path / "r.json", "--num-prompts", "1", "--percentiles", "50, 90,99.9"
    )
    assert r["percentiles"] == [50.0, 90.0, 99.9] and "p99.9_itl_ms" in r
    for bad in ("", "101", "a"):
        with pytest.raises(SystemExit, match="Percentiles must be numbers in"):
            bench_serve("--base-url", server.url, "--model", "m", "--percentiles", bad)


def test_plot_is_skipped_without_matplotlib(scripted, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import raises ImportError
    plot = tmp_path / "p.png"
    r = run_scripted(scripted([stream(0.0, [], 3)]), tmp_path / "r.json", "--num-prompts", "1",
                     "--plot", str(plot))  # fmt: skip
    assert r["completed"] == 1 and not plot.exists()


# ---------------------------------------------------------------- streams and failures


def test_stream_token_chunks_usage_and_failures(scripted, tmp_path):
    """vLLM's token rule: a chunk with content, or content "" without a role (the role chunk
    and the usage chunk are none); failures are recorded in order, not raised."""
    chunks = sse(delta(role="assistant", content=""), delta(content="a"), delta(content=""),
                 delta(content="a"), usage(7, 4), "[DONE]")  # fmt: skip
    script = [
        (200, [(0.0, text) for text in chunks]),
        error_body(404, "no model x"),
        (200, [(0.0, "".join(sse({"error": {"message": "engine died"}}, "[DONE]")))]),
        (200, [(0.0, sse(delta(content="a"))[0])]),  # the connection closes: no [DONE]
        (200, [(0.0, sse("[DONE]")[0])]),
        (200, [(0.0, "data: {not json\n\n")]),
    ]
    r = run_scripted(scripted(script), tmp_path / "r.json", "--num-prompts", "6")
    assert (r["completed"], r["failed"]) == (1, 5)
    assert (r["input_lens"][0], r["output_lens"][0], len(r["itls"][0])) == (7, 4, 2)
    assert 0 <= r["ttfts"][0] <= r["e2els"][0]
    expected = ["HTTP 404: no model x", "Error event: engine died", "before data: [DONE]",
                "without any content chunk", "JSONDecodeError"]  # fmt: skip
    assert len(r["errors"]) == len(expected)
    for error, part in zip(r["errors"], expected, strict=True):
        assert part in error


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
    """``mm-serve bench serve`` as a user runs it (a subprocess); returns its JSON."""
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
    # At most 3 in flight: when a request is sent, at most 2 others are running.
    ends = [s + e for s, e in zip(result["start_times"], result["e2els"], strict=True)]
    for i, sent in enumerate(result["start_times"]):
        running = [j for j, s in enumerate(result["start_times"]) if j != i and s <= sent < ends[j]]
        assert len(running) <= 2
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert_no_running_requests(server)


def test_finite_request_rate_follows_the_arrivals(server, tmp_path):
    flags = ["--num-prompts", "5", "--request-rate", "10", "--seed", "3", "--ignore-eos"]
    result = run_bench(server, tmp_path / "result.json", *flags)
    assert (result["completed"], result["failed"]) == (5, 0)
    assert result["total_output_tokens"] == 5 * OUTPUT_LEN
    # Each request is sent at its arrival time (the dry run's schedule), not before.
    schedule = dry_run(tmp_path, *flags)
    assert result["start_times"] == pytest.approx(schedule, abs=0.25)
    assert all(s >= a for s, a in zip(result["start_times"], schedule, strict=True))
    assert result["duration_s"] >= schedule[-1]
    assert result["settings"]["request_rate"] == 10.0
    assert_no_running_requests(server)


def test_wrong_model_counts_404s(server, tmp_path, capsys):
    # A trailing /v1 in --base-url is accepted, as OpenAI clients spell it.
    path = tmp_path / "r.json"
    flags = ["--model", "nope", "--num-prompts", "3", "--percentiles", "99"]
    assert (
        bench_serve("--base-url", f"{server.url}/v1", *SMALL, *flags, "--output-json", str(path))
        == 0
    )
    result = json.loads(path.read_text())
    assert (result["completed"], result["failed"]) == (0, 3)
    assert all(error.startswith("HTTP 404") for error in result["errors"])
    # No success: every figure 0.
    assert result["request_throughput"] == result["p99_ttft_ms"] == result["mean_itl_ms"] == 0.0
    assert "Failed requests:" in capsys.readouterr().out
    assert_no_running_requests(server)


def test_unreachable_server_counts_connection_errors(tmp_path):
    url, path = f"http://127.0.0.1:{free_port()}", tmp_path / "r.json"
    flags = ["--base-url", url, *SMALL, "--num-prompts", "2", "--output-json", str(path)]
    assert bench_serve(*flags, "--model", "m") == 0
    result = json.loads(path.read_text())
    assert (result["completed"], result["failed"]) == (0, 2)
    assert "ConnectError" in result["errors"][0]
    with pytest.raises(SystemExit, match="error: Cannot reach"):
        bench_serve("--base-url", url)  # no --model: GET /v1/models fails
