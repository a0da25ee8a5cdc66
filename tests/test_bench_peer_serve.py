"""``mm-serve bench peer-serve``: the serving side by side with vLLM, through the CLI.

The report (table rows, verdicts, cold start) from result JSONs written in the format of vLLM
0.33's ``bench serve --save-result --save-detailed``, with ``--report-only``. Then whole runs
with a stand-in ``vllm`` package on ``--vllm-pythonpath`` (``FAKE_VLLM``): its ``bench serve``
sends one chat request as vLLM's openai-chat backend does to our real server (tiny Qwen2-VL
architecture: start, health, serve, stop, port free, process group gone) and fails at a rate
when told to; its ``serve`` dies at start, never gets healthy, or ignores SIGTERM.
"""

from __future__ import annotations

import ast
import json
import os
import shlex
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from mm_serve.entrypoints import cli
from tests.fixtures.server import group_members

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
    done = report_cli(tmp_path)
    assert done.returncode != 0
    assert "vllm_2.json lacks p99_itl_ms, ttfts" in done.stderr and "--save-detailed" in done.stderr


def report_only(folder, *flags: str) -> dict:
    """``bench peer-serve --report-only --out FOLDER FLAGS`` in this process; the report."""
    argv = ["bench", "peer-serve", "--report-only", "--out", str(folder), *flags]
    assert cli.main(argv) == 0
    return json.loads((folder / "peer_serve.json").read_text())


def test_cold_start_needs_two_windows_and_a_success_in_each(tmp_path, capsys):
    # The first 32 requests all failed: no ratio, not passed, no cold-start line.
    write_results(tmp_path, {"mm_serve_2": vllm_result([0.05] * 64, ["error"] * 32 + [""] * 32)})
    cold = report_only(tmp_path)["engines"]["mm_serve"]["cold_start"]
    assert cold["ratio"] is None and not cold["passed"]
    assert "cold start" not in capsys.readouterr().out
    # A first run too short for the figure: the report has its row and no cold start.
    write_results(tmp_path, {"mm_serve_2": vllm_result([0.05] * 8)})
    report = report_only(tmp_path, "--rates", "2", "16", "--num-prompts", "8", "8")
    assert list(report["engines"]["mm_serve"]["runs"]) == ["2"]
    assert "cold_start" not in report["engines"]["mm_serve"]
    assert "vllm" not in report["engines"] and report["verdicts"] == []
    (tmp_path / "mm_serve_2.json").rename(tmp_path / "mm_serve_16.json")
    report = report_only(tmp_path, "--rates", "2", "16", "--num-prompts", "8", "8")
    assert list(report["engines"]["mm_serve"]["runs"]) == ["16"]


# ---------------------------------------------------------------- runs with a stand-in vLLM

FAKE_VLLM = '''
"""A stand-in for ``python -m vllm.entrypoints.cli.main {serve,bench serve} ...``: logs its
command line and environment to $FAKE_VLLM_LOG/<serve|bench-RATE>.json, then acts as told."""
import ast, base64, io, json, os, signal, sys, time

import httpx
import numpy as np
from PIL import Image

argv = sys.argv[1:]
opts = {}  # --flag value, or --flag alone: True
for i, arg in enumerate(argv):
    if arg.startswith("--"):
        alone = i + 1 == len(argv) or argv[i + 1].startswith("--")
        opts[arg] = True if alone else argv[i + 1]
env = {k: os.environ.get(k) for k in ("PYTHONPATH", "VLLM_USE_FLASHINFER_SAMPLER")}
name = "serve" if argv[0] == "serve" else f"bench-{opts['--request-rate']}"
log = {"argv": argv, "env": env}


def save():
    with open(os.path.join(os.environ["FAKE_VLLM_LOG"], name + ".json"), "w") as f:
        json.dump(log, f)


def serve(mode):
    print("loading", flush=True)
    if mode == "die":
        print("no such model")
        sys.exit(3)
    if mode == "hang":
        time.sleep(60)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # "stubborn"
    import http.server

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

    port = int(opts["--port"])
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()


def server_pid(port):
    """The process whose command line serves on ``port`` (the server's group leader)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\\0")
        except OSError:
            continue
        if b"serve" in args and b"--port" in args and args[args.index(b"--port") + 1] == port:
            return int(pid)


def chat():
    """One streamed request with the body and headers of vLLM's openai-chat backend."""
    (height, width, _), = ast.literal_eval(opts["--random-mm-bucket-config"])
    buffer = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 255, (height, width, 3), np.uint8)
    Image.fromarray(pixels).save(buffer, format="JPEG")
    image = base64.b64encode(buffer.getvalue()).decode()
    content = [
        {"type": "text", "text": " ".join(["word"] * int(opts["--random-input-len"]))},
        {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{image}"}},
    ]
    body = {"model": opts["--model"], "messages": [{"role": "user", "content": content}],
            "max_completion_tokens": int(opts["--random-output-len"]), "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": "--ignore-eos" in argv}
    headers = {"Authorization": "Bearer None"}  # vLLM sends $OPENAI_API_KEY, unset here
    url = f"http://127.0.0.1:{opts['--port']}{opts['--endpoint']}"
    start = time.perf_counter()
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    log["usage"] = json.loads(data[-2])["usage"]
    return time.perf_counter() - start


def bench():
    log["server_pid"] = server_pid(opts["--port"].encode())
    if opts["--request-rate"] in os.environ.get("FAKE_VLLM_FAIL_RATES", "").split():
        print("the load generator broke")
        sys.exit(1)
    ttft = chat() if os.environ.get("FAKE_VLLM_CHAT") else 0.1
    result = {"completed": 1, "failed": 0, "median_ttft_ms": ttft * 1000,
              "p99_ttft_ms": ttft * 1000, "median_tpot_ms": 1.0, "p99_itl_ms": 1.0,
              "output_throughput": 1.0, "ttfts": [ttft], "errors": [""]}
    with open(os.path.join(opts["--result-dir"], opts["--result-filename"]), "w") as f:
        json.dump(result, f)


try:
    if argv[0] == "serve":
        save()
        serve(os.environ["FAKE_VLLM_SERVE"])
    else:
        bench()
finally:
    save()
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch) -> str:
    """A site folder with the stand-in ``vllm`` package; its logs go to ``tmp_path/log``."""
    site = tmp_path / "site"
    package = site / "vllm" / "entrypoints" / "cli"
    package.mkdir(parents=True)
    for folder in (site / "vllm", site / "vllm" / "entrypoints", package):
        (folder / "__init__.py").write_text("")
    (package / "main.py").write_text(FAKE_VLLM)
    (tmp_path / "log").mkdir()
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "log"))
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    return str(site)


def fake_log(tmp_path, name: str) -> dict:
    return json.loads((tmp_path / "log" / f"{name}.json").read_text())


def test_our_server_starts_serves_and_stops(fake_vllm, tmp_path, monkeypatch):
    """The load generator runs at 2 req/s (one chat request), fails at 16: the failure is
    recorded with the log's tail, the server stopped, 32 not run, the report still written."""
    monkeypatch.setenv("FAKE_VLLM_CHAT", "1")
    monkeypatch.setenv("FAKE_VLLM_FAIL_RATES", "16")
    out, cpu = tmp_path / "out", "--device cpu --max-model-len 1024 --num-kv-blocks 80"
    command = [sys.executable, "-m", "mm_serve.entrypoints.cli", "bench", "peer-serve"]
    command += ["--model-arch", "tiny-qwen2-vl", "--out", str(out), "--engines", "mm_serve"]
    command += ["--rates", "2", "16", "32", "--num-prompts", "1", "1", "1"]
    command += ["--mm-serve-args", f"{cpu} --mm-preprocess-workers 1"]
    done = subprocess.run([*command, "--vllm-pythonpath", fake_vllm], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    info = json.loads((out / "mm_serve_server.json").read_text())
    folder, server_command = str(out / "tiny-qwen2-vl"), info["server_command"]
    port = server_command[server_command.index("--port") + 1]
    assert server_command[:9] == [sys.executable, "-m", "mm_serve.entrypoints.launch", "serve",
                                  folder, "--load-format", "dummy", "--port", port]  # fmt: skip
    assert server_command[9:] == [*shlex.split(cpu), "--mm-preprocess-workers", "1"]
    assert info["startup_s"] > 0 and info["server_exit_code"] is not None
    assert "vllm bench serve exited with 1" in info["error"]
    assert "the load generator broke" in info["error"]  # the log's tail
    assert "mm_serve FAILED: vllm bench serve exited with 1:" in done.stdout

    bench = fake_log(tmp_path, "bench-2")
    usage = bench["usage"]
    assert usage["completion_tokens"] == 128  # ignore_eos: exactly --random-output-len
    assert usage["prompt_tokens"] > 50  # text + image tokens
    report = json.loads((out / "peer_serve.json").read_text())
    row = report["engines"]["mm_serve"]["runs"]
    assert list(row) == ["2"] and (row["2"]["completed"], row["2"]["failed"]) == (1, 0)
    assert [p.name for p in sorted(out.glob("mm_serve_*.log"))] == [
        "mm_serve_16.log", "mm_serve_2.log", "mm_serve_server.log"]  # fmt: skip

    server_log = (out / "mm_serve_server.log").read_text()
    assert '"GET /health HTTP/1.1" 200' in server_log and "Shutting down" in server_log
    assert bench["server_pid"] and group_members(bench["server_pid"]) == []  # workers too
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")

    # The load generator's command line: vLLM's `bench serve` with the peer README's workload.
    line = shlex.join(bench["argv"])
    assert line.startswith("bench serve --backend openai-chat --endpoint /v1/chat/completions ")
    assert f"--model {folder} --port {port} --num-prompts 1 --request-rate 2 " in line
    expected = (
        "--dataset-name random-mm --random-input-len 50 --random-output-len 128 "
        "--random-range-ratio 0 --random-mm-base-items-per-request 1 "
        "--random-mm-num-mm-items-range-ratio 0"
    )
    assert expected in line
    argv = bench["argv"]
    flag = argv.index("--random-mm-limit-mm-per-prompt")
    assert json.loads(argv[flag + 1]) == {"image": 1, "video": 0}
    assert ast.literal_eval(argv[argv.index("--random-mm-bucket-config") + 1]) == {
        (448, 448, 1): 1.0
    }
    assert line.endswith(
        f"--ignore-eos --save-result --save-detailed --result-dir {out} --result-filename "
        "mm_serve_2.json"
    )
    # vLLM's site first on PYTHONPATH; FlashInfer's sampler off.
    assert bench["env"]["PYTHONPATH"].split(os.pathsep)[0] == fake_vllm
    assert bench["env"]["VLLM_USE_FLASHINFER_SAMPLER"] == "0"


def peer_serve_vllm(tmp_path, site: str, *flags: str) -> dict:
    """``bench peer-serve --engines vllm`` in this process with the stand-in; the engine's
    ``vllm_server.json``."""
    argv = ["bench", "peer-serve", "--model-arch", "tiny-qwen2-vl", "--out", str(tmp_path / "out")]
    argv += ["--engines", "vllm", "--rates", "2", "--num-prompts", "1"]
    assert cli.main([*argv, "--vllm-pythonpath", site, *flags]) == 0
    return json.loads((tmp_path / "out" / "vllm_server.json").read_text())


def test_a_server_that_dies_fails_with_its_log_tail(fake_vllm, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_VLLM_SERVE", "die")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([fake_vllm, "/a"]))  # already first
    info = peer_serve_vllm(tmp_path, fake_vllm, "--vllm-args=--enforce-eager")
    assert "The server exited with code 3:\nloading\nno such model" in info["error"]
    assert "vllm FAILED: The server exited with code 3:" in capsys.readouterr().out
    serve = fake_log(tmp_path, "serve")
    folder, port = str(tmp_path / "out" / "tiny-qwen2-vl"), serve["argv"][5]
    assert serve["argv"] == ["serve", folder, "--load-format", "dummy", "--port", port,
                             "--max-model-len", "4096", "--limit-mm-per-prompt",
                             '{"image":1,"video":0}', "--enforce-eager"]  # fmt: skip
    assert info["server_command"][:3] == [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    assert serve["env"]["PYTHONPATH"] == os.pathsep.join([fake_vllm, "/a"])  # not twice
    assert serve["env"]["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    with pytest.raises(SystemExit):  # no such engine
        cli.main(["bench", "peer-serve", "--out", str(tmp_path), "--engines", "sglang"])


def test_a_server_never_healthy_is_stopped_at_the_timeout(fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_SERVE", "hang")
    start = time.monotonic()
    info = peer_serve_vllm(tmp_path, fake_vllm, "--startup-timeout", "1")
    assert "The server was not healthy within 1.0 s:\nloading" in info["error"]
    assert time.monotonic() - start < 20  # SIGTERM ended it; no 60 s sleep


def test_a_server_ignoring_sigterm_is_killed(fake_vllm, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_VLLM_SERVE", "stubborn")
    start = time.monotonic()
    info = peer_serve_vllm(tmp_path, fake_vllm, "--shutdown-timeout", "1")
    assert 1 <= time.monotonic() - start < 20
    assert info["server_exit_code"] == -9 and "error" not in info  # SIGKILL
    assert "vllm server ignored SIGTERM: killed after --shutdown-timeout" in capsys.readouterr().out
    pid = fake_log(tmp_path, "bench-2")["server_pid"]
    assert pid and group_members(pid) == []
