"""``mm-serve serve --api-server-count 2``: two API-server processes, one engine core.

A real server on the tiny Qwen2-VL (conftest's ``vlm_path``, sized as ``vlm_llm``, the offline
reference): concurrent chat requests land on both processes (the ``x-mm-serve-pid`` header)
and each answer is the offline greedy one; ``/metrics`` on either process counts all of them;
a killed API server, engine core or main process takes the whole server down, leaving no
process behind.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from mm_serve import SamplingParams
from mm_serve.config import EngineArgs
from mm_serve.entrypoints.cli import build_parser, server_config_from
from mm_serve.entrypoints.launch import _api_server_count
from mm_serve.entrypoints.openai.multi_api_server import SERVED_BY_HEADER, check_supported
from tests.fixtures.server import (
    VLM_MAX_MODEL_LEN,
    VLM_NUM_KV_BLOCKS,
    VLM_SERVED_NAME,
    RemoteServer,
    assert_group_gone,
    image_question,
    metric,
    noise_png_url,
    serve_checked,
)

ARGS = [
    "--max-model-len", str(VLM_MAX_MODEL_LEN),
    "--num-kv-blocks", str(VLM_NUM_KV_BLOCKS),
    "--served-model-name", VLM_SERVED_NAME,
    "--api-server-count", "2",
]  # fmt: skip
MAX_TOKENS = 8
NUM_REQUESTS = 24
QUERIES = "mm_serve_processor_cache_queries_total"


def conversation(i: int) -> list[dict]:
    """Every third request asks about a small image; the others are text only."""
    if i % 3 == 0:
        return image_question(noise_png_url(i, 56, 56))
    return [{"role": "user", "content": f"Count to {i}."}]


def chat(url: str, i: int) -> httpx.Response:
    body = {
        "model": VLM_SERVED_NAME,
        "messages": conversation(i),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def pids_seen(url: str, path: str, tries: int = 40) -> dict[int, httpx.Response]:
    """``GET path`` until both API servers answered (or ``tries`` ran out): pid -> response."""
    answers = {}
    for _ in range(tries):
        response = httpx.get(f"{url}{path}", timeout=30)
        answers[int(response.headers[SERVED_BY_HEADER])] = response
        if len(answers) == 2:
            break
    return answers


def test_flag_and_launcher_agree():
    for argv, count in [([], 1), (["--api-server-count", "3"], 3), (["--api-server-count=2"], 2)]:
        args = build_parser(["serve", *argv]).parse_args(["serve", *argv])
        assert server_config_from(args).api_server_count == count
        assert _api_server_count(["serve", *argv]) == count
    assert _api_server_count(["serve", "--api-server-count", "many"]) == 1  # argparse refuses it


def test_unsupported_combinations_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        check_supported(EngineArgs(model="m"), 0)
    for engine_args in (
        EngineArgs(model="m", data_parallel_size=2),
        EngineArgs(model="m", data_parallel_backend="ray"),
    ):
        with pytest.raises(ValueError, match="one local engine core"):
            check_supported(engine_args, 2)
        check_supported(engine_args, 1)


@pytest.fixture(scope="module")
def server(vlm_path):
    yield from serve_checked(vlm_path, ARGS)


def test_answers_equal_offline_on_both_processes(server, vlm_llm):
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda i: chat(server.url, i), range(NUM_REQUESTS)))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    references = vlm_llm.chat([conversation(i) for i in range(NUM_REQUESTS)], params, False)
    for response, reference in zip(responses, references, strict=True):
        assert response.json()["choices"][0]["message"]["content"] == reference.outputs[0].text
    served_by = {int(r.headers[SERVED_BY_HEADER]) for r in responses}
    assert len(served_by) == 2 and os.getpid() not in served_by


def test_metrics_count_the_whole_server(server):
    before = pids_seen(server.url, "/metrics")
    assert len(before) == 2
    (total,) = {metric(r.text, "mm_serve_request_success_total") for r in before.values()}
    with ThreadPoolExecutor(4) as pool:
        assert all(r.status_code == 200 for r in pool.map(lambda i: chat(server.url, i), range(8)))
    pids_seen(server.url, "/metrics")  # each process publishes its processor-cache counters
    after = pids_seen(server.url, "/metrics")
    assert len(after) == 2
    for response in after.values():
        assert metric(response.text, "mm_serve_request_success_total") == total + 8
        assert metric(response.text, "mm_serve_num_requests_running") == 0  # the engine's
    # Each process has its own processor cache; both show the sum (3 of the 8 had an image).
    (queries,) = {metric(r.text, QUERIES) for r in after.values()}
    assert queries >= max(metric(r.text, QUERIES) for r in before.values()) + 3


def test_health_models_and_page_on_both_processes(server):
    for path in ("/health", "/v1/models", "/"):
        answers = pids_seen(server.url, path)
        assert len(answers) == 2
        assert all(r.status_code == 200 for r in answers.values()), path
    (models,) = {r.text for r in pids_seen(server.url, "/v1/models").values()}
    assert VLM_SERVED_NAME in models


def server_pids(remote: RemoteServer) -> dict[str, int]:
    """The main process, one API server and the engine core of ``remote``."""
    api_servers = set(pids_seen(remote.url, "/health"))
    assert len(api_servers) == 2
    children = psutil.Process(remote.proc.pid).children()
    (engine_core,) = [
        p.pid
        for p in children
        if p.pid not in api_servers and "resource_tracker" not in " ".join(p.cmdline())
    ]
    return {"main": remote.proc.pid, "api-server": min(api_servers), "engine-core": engine_core}


@pytest.mark.parametrize("victim", ["api-server", "engine-core", "main"])
def test_a_killed_process_takes_the_whole_server_down(vlm_path, victim):
    remote = RemoteServer(vlm_path, ARGS)
    try:
        os.kill(server_pids(remote)[victim], signal.SIGKILL)
        start = time.monotonic()
        assert remote.proc.wait(timeout=20) == (-signal.SIGKILL if victim == "main" else 1)
        assert time.monotonic() - start < 15
        assert_group_gone(remote.proc.pid, timeout_s=10)
    finally:
        remote.stop()
