"""``mm-serve bench peer-serve``: the serving side by side with vLLM.

The report (table rows, verdicts, cold start) from result JSONs written in the format of vLLM
0.33's ``bench serve --save-result --save-detailed``, through the real CLI. Then the server
helpers against real processes: our server on the tiny Qwen2-VL architecture (start, health,
one chat request as vLLM's openai-chat backend sends it, stop, port free), a server that dies
at start, one that never gets healthy and one that ignores SIGTERM. vLLM's load generator
itself is not faked: it runs on the GPU machine only.
"""

from __future__ import annotations

import ast
import base64
import importlib.util
import io
import json
import shlex
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from mm_serve.benchmarks import peer_serve, peer_serve_report
from mm_serve.entrypoints import cli
from tests.fixtures.checkpoints import write_architecture
from tests.fixtures.server import free_port, group_members

# ---------------------------------------------------------------- report


def vllm_result(ttfts: list[float], errors: list[str] | None = None, **fields) -> dict:
    """A result JSON shaped as vLLM 0.33's ``bench serve`` writes it with ``--save-detailed``;
    TTFT statistics computed from ``ttfts`` (s) over the successful requests, as vLLM does."""
    errors = errors or [""] * len(ttfts)
    ok = [t for t, e in zip(ttfts, errors, strict=True) if not e]
    n = len(ttfts)
    result = {
        "date": "20261124-120000", "endpoint_type": "openai-chat", "backend": "openai-chat",
        "label": None, "model_id": "/tmp/arch", "tokenizer_id": "/tmp/arch", "num_prompts": n,
        "request_rate": 2.0, "burstiness": 1.0, "max_concurrency": None, "duration": 30.0,
        "completed": len(ok), "failed": n - len(ok), "total_input_tokens": 306 * len(ok),
        "total_output_tokens": 128 * len(ok), "request_throughput": len(ok) / 30.0,
        "request_goodput": None, "output_throughput": 128 * len(ok) / 30.0,
        "total_token_throughput": 434 * len(ok) / 30.0, "input_lens": [306] * n,
        "output_lens": [128 if not e else 0 for e in errors], "ttfts": ttfts,
        "itls": [[0.004] * 127 for _ in ttfts], "latencies": [t + 0.5 for t in ttfts],
        "start_times": [0.5 * i for i in range(n)], "queue_times": [0.0] * n,
        "generated_texts": ["" for _ in ttfts], "errors": errors,
        "max_output_tokens_per_s": 700.0, "max_concurrent_requests": 3, "rtfx": 0.0,
        "mean_ttft_ms": float(np.mean(ok)) * 1000, "median_ttft_ms": float(np.median(ok)) * 1000,
        "std_ttft_ms": float(np.std(ok)) * 1000, "p99_ttft_ms": np.percentile(ok, 99) * 1000,
        "mean_tpot_ms": 4.0, "median_tpot_ms": 4.0, "std_tpot_ms": 0.1, "p99_tpot_ms": 4.5,
        "mean_itl_ms": 4.0, "median_itl_ms": 4.0, "std_itl_ms": 0.1, "p99_itl_ms": 9.0,
        "mean_e2el_ms": 600.0, "median_e2el_ms": 600.0, "std_e2el_ms": 1.0, "p99_e2el_ms": 700.0,
    }  # fmt: skip
    return {**result, **fields}


def write_results(folder, results: dict[str, dict]) -> None:
    for name, result in results.items():
        (folder / f"{name}.json").write_text(json.dumps(result))


def report_cli(folder) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mm_serve.entrypoints.cli", "bench", "peer-serve"]
    command += ["--report-only"]
    return subprocess.run(
        [*command, "--out", str(folder)], capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def results_dir(tmp_path):
    """Both engines at 2, 16, 32 req/s. mm_serve at 2 req/s: first 32 TTFTs 50 ms, next 32
    40 ms, one failed request in the first 32 (ttft 0, as vLLM records it); vLLM at 2 req/s:
    200 ms then 100 ms. At 16 req/s mm_serve has the lower median but the higher p99."""
    failed = ["Traceback: ClientPayloadError"] + [""] * 63
    ours_2 = vllm_result([0.0] + [0.050] * 31 + [0.040] * 32, failed, median_tpot_ms=3.0)
    ours_16 = vllm_result([0.030] * 376 + [0.900] * 8, median_tpot_ms=5.0)
    peer_16 = vllm_result([0.140] * 376 + [0.400] * 8, median_tpot_ms=6.0)
    write_results(tmp_path, {
        "mm_serve_2": ours_2,
        "mm_serve_16": ours_16,
        "mm_serve_32": vllm_result([0.050] * 384, output_throughput=2900.0),
        "vllm_2": vllm_result([0.200] * 32 + [0.100] * 32, median_tpot_ms=2.9),
        "vllm_16": peer_16,
        "vllm_32": vllm_result([0.180] * 384, output_throughput=2800.0),
    })  # fmt: skip
    # The load generator's logs: vLLM's run began with a ready-check request (not cold).
    (tmp_path / "mm_serve_2.log").write_text("Skipping endpoint ready check.\nStarting main\n")
    (tmp_path / "vllm_2.log").write_text("Initial test run completed.\nStarting main\n")
    return tmp_path


def test_report_table_verdicts_and_cold_start(results_dir):
    done = report_cli(results_dir)
    assert done.returncode == 0, done.stderr
    report = json.loads((results_dir / "peer_serve.json").read_text())
    ours, peer = report["engines"]["mm_serve"], report["engines"]["vllm"]
    assert list(ours["runs"]) == ["2", "16", "32"]
    row = ours["runs"]["2"]
    assert (row["completed"], row["failed"]) == (63, 1)
    assert row["ttft_median_ms"] == pytest.approx(40.0)  # the failure's 0 s is not counted
    assert (row["tpot_median_ms"], row["itl_p99_ms"]) == (3.0, 9.0)
    assert row["output_tok_s"] == pytest.approx(128 * 63 / 30)
    assert ours["runs"]["16"]["ttft_p99_ms"] == pytest.approx(900.0)
    # Cold start over successful requests only: 50 ms (31 of the first 32) vs 40 ms.
    cold = ours["cold_start"]
    assert (cold["first_median_ms"], cold["next_median_ms"]) == pytest.approx((50.0, 40.0))
    assert cold["ratio"] == pytest.approx(1.25) and cold["passed"]
    assert peer["cold_start"]["ratio"] == pytest.approx(2.0) and not peer["cold_start"]["passed"]
    assert not cold["after_test_request"] and peer["cold_start"]["after_test_request"]

    passed = {(v["rate"], v["metric"]): v["passed"] for v in report["verdicts"]}
    assert passed == {
        ("2", "failed"): False,  # one failed request
        ("2", "ttft_median_ms"): True,
        ("2", "ttft_p99_ms"): True,
        ("2", "tpot_median_ms"): False,  # 3.0 > 2.9
        ("16", "failed"): True,
        ("16", "ttft_median_ms"): True,
        ("16", "ttft_p99_ms"): False,  # 900 > 400
        ("16", "tpot_median_ms"): True,
        ("32", "failed"): True,
        ("32", "ttft_median_ms"): True,
        ("32", "ttft_p99_ms"): True,
        ("32", "tpot_median_ms"): True,
    }
    lines = done.stdout.strip().splitlines()
    assert lines[-7].split() == ["engine", "req/s", "done", "failed", "TTFT", "med", "TTFT",
                                 "p99", "TPOT", "med", "ITL", "p99", "out", "tok/s"]  # fmt: skip
    assert lines[-6].split() == ["mm_serve", "2", "63", "1", "40.0", "50.0", "3.00", "9.0", "269"]
    assert lines[-1].split()[:2] == ["vllm", "32"] and lines[-1].split()[-1] == "2800"
    (line,) = [line for line in lines if "16 req/s ttft_p99_ms" in line]
    assert line.split()[3:] == ["mm_serve", "900.00", "vLLM", "400.00", "mm_serve", "<=", "vLLM:",
                                "NO"]  # fmt: skip
    assert "cold start mm_serve: TTFT median of requests 1-32 50.0 ms, 33-64 40.0 ms: 1.25x" in (
        done.stdout
    )
    assert "1.25x (<= 1.5x: yes)\n" in done.stdout
    assert "2.00x (<= 1.5x: NO) after one test request" in done.stdout  # vLLM's


def test_missing_field_is_a_clear_error(tmp_path):
    result = vllm_result([0.05] * 64)
    del result["p99_itl_ms"], result["ttfts"]
    write_results(tmp_path, {"vllm_2": result})
    with pytest.raises(peer_serve_report.ResultFormatError, match="lacks p99_itl_ms, ttfts"):
        peer_serve_report.load_result(str(tmp_path / "vllm_2.json"))
    done = report_cli(tmp_path)
    assert done.returncode != 0
    assert "vllm_2.json lacks p99_itl_ms, ttfts" in done.stderr and "--save-detailed" in done.stderr


def test_cold_start_needs_two_windows_and_a_success_in_each(tmp_path):
    with pytest.raises(ValueError, match="needs 64 requests"):
        peer_serve_report.cold_start(vllm_result([0.05] * 63))
    all_failed = vllm_result([0.05] * 64, ["error"] * 32 + [""] * 32)
    assert peer_serve_report.cold_start(all_failed)["ratio"] is None
    assert not peer_serve_report.cold_start(all_failed)["passed"]
    # A first run too short for the figure: the report has its row and no cold start.
    write_results(tmp_path, {"mm_serve_2": vllm_result([0.05] * 8)})
    report = peer_serve_report.build_report(str(tmp_path), ["mm_serve", "vllm"], [2.0, 16.0])
    assert list(report["engines"]["mm_serve"]["runs"]) == ["2"]
    assert "cold_start" not in report["engines"]["mm_serve"]
    assert "vllm" not in report["engines"] and report["verdicts"] == []


def test_commands_carry_the_peer_readme_flags():
    bench = peer_serve.bench_command("/m", 8124, 16.0, 384, "/out", "vllm_16.json")
    line = shlex.join(bench)
    assert "-m vllm.entrypoints.cli.main bench serve --backend openai-chat --endpoint " in line
    assert "--model /m --port 8124 --num-prompts 384 --request-rate 16 " in line
    expected = (
        "--dataset-name random-mm --random-input-len 50 --random-output-len 128 "
        "--random-range-ratio 0 --random-mm-base-items-per-request 1 "
        "--random-mm-num-mm-items-range-ratio 0"
    )
    assert expected in line
    flag = bench.index("--random-mm-limit-mm-per-prompt")
    assert json.loads(bench[flag + 1]) == {"image": 1, "video": 0}
    flag = bench.index("--random-mm-bucket-config")
    assert ast.literal_eval(bench[flag + 1]) == {(448, 448, 1): 1.0}
    assert line.endswith(
        "--ignore-eos --save-result --save-detailed --result-dir /out --result-filename "
        "vllm_16.json"
    )
    vllm = peer_serve.server_command("vllm", "/m", 9000)
    assert vllm[1:] == ["-m", "vllm.entrypoints.cli.main", "serve", "/m", "--load-format",
                        "dummy", "--port", "9000", "--max-model-len", "4096",
                        "--limit-mm-per-prompt", '{"image":1,"video":0}']  # fmt: skip
    assert peer_serve_report.result_filename("mm_serve", 2.0) == "mm_serve_2.json"
    with pytest.raises(ValueError, match="Unknown engine"):
        peer_serve.server_command("sglang", "/m", 9000)


def test_vllm_env_puts_its_site_first(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/a")
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    env = peer_serve.vllm_env("/tmp/vsite")
    assert env["PYTHONPATH"] == "/tmp/vsite:/a"
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert peer_serve.vllm_env("/a")["PYTHONPATH"] == "/a"


# ---------------------------------------------------------------- servers


def chat_as_vllm_bench_sends_it(port: int, max_tokens: int) -> list[dict]:
    """One streamed chat request with the body and headers of vLLM's openai-chat backend;
    returns the SSE events before ``[DONE]``."""
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 56, 3), np.uint8)).save(
        buffer, format="JPEG"
    )
    image = base64.b64encode(buffer.getvalue()).decode()
    content = [
        {"type": "text", "text": "reference numbers quickly"},
        {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{image}"}},
    ]
    body = {
        "model": httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"],
        "messages": [{"role": "user", "content": content}],
        "max_completion_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    headers = {"Authorization": "Bearer None"}  # vLLM sends $OPENAI_API_KEY, unset here
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(event) for event in data[:-1]]


def test_our_server_starts_serves_and_stops(tmp_path):
    folder = write_architecture("tiny-qwen2-vl", tmp_path / "arch")
    cpu = ["--device", "cpu", "--max-model-len", "512", "--num-kv-blocks", "64"]
    port = free_port()
    command = peer_serve.server_command(
        "mm_serve", folder, port, [*cpu, "--mm-preprocess-workers", "1"]
    )
    server = peer_serve.start_server(command, port, str(tmp_path / "server.log"), timeout_s=300)
    try:
        assert server.startup_s > 0 and not peer_serve.port_is_free(port)
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        events = chat_as_vllm_bench_sends_it(port, max_tokens=4)
        assert events[-1]["usage"]["completion_tokens"] == 4  # ignore_eos: exactly 4
        assert events[-1]["usage"]["prompt_tokens"] > 4  # text + image tokens
    finally:
        code = peer_serve.stop_server(server)
    assert code is not None and peer_serve.port_is_free(port)
    assert group_members(server.proc.pid) == []  # engine core and workers gone too
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")
    assert "serve" in (tmp_path / "server.log").read_text()


def test_a_server_that_dies_fails_with_its_log_tail(tmp_path):
    command = [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited with code 3:\nno such model"):
        peer_serve.start_server(command, free_port(), str(tmp_path / "log"))


def test_a_server_never_healthy_is_stopped_at_the_timeout(tmp_path):
    command = [sys.executable, "-c", "print('loading', flush=True); import time; time.sleep(60)"]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="not healthy within 1 s:\nloading"):
        peer_serve.start_server(command, free_port(), str(tmp_path / "log"), timeout_s=1)
    assert time.monotonic() - start < 20  # SIGTERM ended it; no 60 s sleep


def test_a_server_ignoring_sigterm_is_killed(tmp_path):
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up')"
    proc = subprocess.Popen(
        [sys.executable, "-c", code + "; import sys; sys.stdout.flush(); time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout.readline() == "up\n"  # SIGTERM is ignored from here on
    server = peer_serve.ServerProcess(proc, free_port(), str(tmp_path / "log"))
    start = time.monotonic()
    assert peer_serve.stop_server(server, timeout_s=1) == -9  # SIGKILL
    assert 1 <= time.monotonic() - start < 20


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM would run")
def test_an_engine_whose_load_generator_fails_is_recorded_and_stopped(tmp_path):
    """Without vLLM the load generator exits at once: the run records the error with the
    log's tail, stops our server (port free) and still writes the report."""
    cpu = "--device cpu --max-model-len 512 --num-kv-blocks 64 --mm-preprocess-workers 1"
    argv = ["bench", "peer-serve", "--model-arch", "tiny-qwen2-vl", "--out", str(tmp_path)]
    argv += ["--engines", "mm_serve", "--mm-serve-args", cpu, "--vllm-pythonpath", ""]
    args = cli.build_parser(argv).parse_args(argv)
    assert args.func(args) == 0
    report = json.loads((tmp_path / "peer_serve.json").read_text())
    info = json.loads((tmp_path / "mm_serve_server.json").read_text())
    assert "vllm bench serve exited with 1" in info["error"] and "vllm" in info["error"]
    assert report["engines"] == {"mm_serve": {**info, "runs": {}}}
    log = (tmp_path / "mm_serve_server.log").read_text()
    assert '"GET /health HTTP/1.1" 200' in log and "Shutting down" in log
    assert (tmp_path / "mm_serve_2.log").exists() and not (tmp_path / "mm_serve_16.log").exists()
    port = int(info["server_command"][info["server_command"].index("--port") + 1])
    assert peer_serve.port_is_free(port)
    assert info["server_command"][-len(shlex.split(cpu)) :] == shlex.split(cpu)
