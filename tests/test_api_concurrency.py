"""The server under load and under failure: 200 concurrent streams with a third of them cut
midway leave nothing behind in the engine, and a killed engine core fails in-flight requests
at once and takes the server down with a non-zero exit code.

One server is shared by the module; ``test_engine_death`` kills its engine, so it runs last.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from test_api_server import data_url, photo_path, user

from tests.fixtures.server import RemoteServer, assert_group_gone, metric
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

NUM_REQUESTS = 200
# A model length that lets the given-up requests run for seconds; KV blocks for all of them.
ENGINE_FLAGS = ["--max-model-len", "4096", "--num-kv-blocks", "4096"]
FAIL_FAST_S = 1.0  # in-flight requests must fail within this after the engine core dies


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", seed=6)
    remote = RemoteServer(path, ENGINE_FLAGS)
    yield remote
    remote.stop()
    assert_group_gone(remote.proc.pid)


def request_body(index: int, max_tokens: int) -> dict:
    """Every fourth request carries one of two photos; the rest are text."""
    text = f"Request {index}: say something."
    if index % 4 == 0:
        name = "grace_hopper.jpg" if index % 8 == 0 else "rocket.jpg"
        messages = user(text, data_url(photo_path(name)))
    else:
        messages = user(text)
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.8,
        "seed": index,
        "stream": True,
    }


async def stream_events(response: httpx.Response):
    """The JSON data of each SSE event; stops at ``[DONE]``."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        yield json.loads(line.removeprefix("data: "))


async def run_one(client: httpx.AsyncClient, index: int, cancel: bool) -> str | None:
    """Stream one request; a cancelled one closes its stream after the first content chunk.
    Returns the finish reason (None when cancelled). A cancelled one asks for 320 tokens: it
    must still be running when the server sees the connection close, however loaded the
    machine (with 64, a busy CI machine finished some before noticing)."""
    body = request_body(index, max_tokens=320 if cancel else 6)
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        finish_reason = None
        async for event in stream_events(response):
            assert "error" not in event, event
            choice = event["choices"][0]
            if cancel and choice["delta"].get("content"):
                return None  # leaving the block closes the connection midway
            finish_reason = choice["finish_reason"] or finish_reason
        return finish_reason


async def wait_idle(client: httpx.AsyncClient, timeout_s: float = 10.0) -> str:
    """The metrics text once the engine holds no request, KV block or encoder-cache ref."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = (await client.get("/metrics")).text
        gauges = [
            metric(text, "mm_serve_" + name)
            for name in (
                "num_requests_running",
                "num_requests_waiting",
                "kv_cache_usage_perc",
                "encoder_cache_usage_perc",
            )
        ]
        if not any(gauges) or time.monotonic() > deadline:
            assert not any(gauges), gauges
            return text
        await asyncio.sleep(0.2)


async def wait_counted(
    client: httpx.AsyncClient, name: str, value: float, timeout_s: float = 10.0
) -> str:
    """The metrics text once the counter ``name`` reached ``value`` (or the timeout passed)."""
    deadline = time.monotonic() + timeout_s
    text = (await client.get("/metrics")).text
    while metric(text, name) < value and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        text = (await client.get("/metrics")).text
    return text


async def wait_running(client: httpx.AsyncClient, num: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while metric((await client.get("/metrics")).text, "mm_serve_num_requests_running") < num:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)


def test_concurrent_streams_with_cancellations(server):
    """200 streams, a third closed midway, while 10 long non-streaming requests running in
    the engine are given up by their clients: the rest complete, nothing is left behind."""
    cancelled = [i % 3 == 0 for i in range(NUM_REQUESTS)]
    num_given_up = 10

    async def run():
        limits = httpx.Limits(max_connections=NUM_REQUESTS + num_given_up + 10)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as client:
            before = (await client.get("/metrics")).text
            # Long enough to still run when their clients give up, however fast the machine.
            long = {**request_body(1, max_tokens=4000), "stream": False}
            given_up = [
                asyncio.ensure_future(client.post("/v1/chat/completions", json=long))
                for _ in range(num_given_up)
            ]
            await wait_running(client, num_given_up)
            streams = asyncio.gather(
                *(run_one(client, i, cancel) for i, cancel in enumerate(cancelled))
            )
            await asyncio.sleep(0.2)
            for task in given_up:
                task.cancel()
            results = await streams
            await wait_idle(client)
            # A cancelled request's handler records its abort when it unwinds, which can
            # trail the engine going idle: wait for the front end's count too.
            after = await wait_counted(client, aborted, metric(before, aborted) + num_aborted)
            return before, results, after

    aborted = 'mm_serve_request_success_total{finished_reason="abort"}'
    num_aborted = sum(cancelled) + num_given_up
    before, results, after = asyncio.run(run())
    for result, cancel in zip(results, cancelled, strict=True):
        assert result == (None if cancel else "length")
    assert metric(after, aborted) - metric(before, aborted) == num_aborted
    length = 'mm_serve_request_success_total{finished_reason="length"}'
    assert metric(after, length) - metric(before, length) == NUM_REQUESTS - sum(cancelled)
    closed = 'mm_serve_http_requests_total{endpoint="/v1/chat/completions",status="499"}'
    assert metric(after, closed) == num_given_up
    assert metric(after, "mm_serve_encoder_tokens_computed_total") > 0


def engine_core_pid(server_pid: int) -> int:
    """The engine core: the server's child started by multiprocessing's spawn."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == server_pid and b"spawn_main" in Path(f"/proc/{entry}/cmdline").read_bytes():
                pids.append(int(entry))
        except (OSError, ValueError):
            continue
    (pid,) = pids
    return pid


def test_engine_death(server):
    async def in_flight(client: httpx.AsyncClient, started: asyncio.Event) -> float:
        """Stream a long request; returns when it failed, after ``started`` was set."""
        body = request_body(1, max_tokens=400)
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for event in stream_events(response):
                if "error" in event:
                    assert event["error"]["code"] == "engine_dead"
                    return time.monotonic()
                started.set()
        raise AssertionError("the stream ended without an error")

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            events = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.ensure_future(in_flight(client, e)) for e in events]
            for event in events:
                await asyncio.wait_for(event.wait(), 30)
            body = {**request_body(2, max_tokens=400), "stream": False}
            plain = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
            await asyncio.sleep(0.3)
            killed_at = time.monotonic()
            os.kill(engine_core_pid(server.proc.pid), signal.SIGKILL)
            failed_at = await asyncio.gather(*streams)
            response = await plain
            assert response.status_code == 503, response.text
            assert time.monotonic() - killed_at < FAIL_FAST_S
            assert max(failed_at) - killed_at < FAIL_FAST_S
            assert (await client.get("/health")).status_code == 503

    asyncio.run(run())
    assert server.proc.wait(timeout=15) == 1
    assert_group_gone(server.proc.pid)  # the server's own cleanup, before the fixture's kill
