"""Shutting down: a clean stop of ``mm-serve serve`` prints no finalization noise (Triton's
nanobind "leaked" lines) and lets the requests in flight finish; a failing process keeps its
standard error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from tests.fixtures.server import RemoteServer, assert_group_gone


def test_a_stopped_server_exits_quietly(vlm_path, tmp_path):
    log = tmp_path / "server.log"
    with open(log, "w") as stderr:
        server = RemoteServer(vlm_path, ["--max-model-len", "512"], stderr=stderr)
        assert server.stop() == 0
    assert_group_gone(server.proc.pid)
    text = log.read_text()
    assert "The engine core stopped its threads and sockets" in text  # the log is all there
    assert "nanobind" not in text and "Traceback" not in text


def test_a_failed_command_keeps_its_standard_error(tmp_path):
    command = [sys.executable, "-m", "mm_serve.entrypoints.launch", "run-batch", str(tmp_path)]
    command += ["-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "out.jsonl")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "Cannot run the batch" in done.stderr and "missing.jsonl" in done.stderr


def streamed_tokens_across_sigterm(server: RemoteServer, max_tokens: int) -> int | None:
    """Stream a chat answer, SIGTERM the API server (alone, as an orchestrator does) once it
    is under way; the answer's completion tokens, None if the stream was cut."""
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage = None
    try:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # under way
            os.kill(server.proc.pid, signal.SIGTERM)
            for line in lines:
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
    except httpx.HTTPError:
        return None
    return None if usage is None else usage["completion_tokens"]


@pytest.mark.parametrize(("timeout", "finished"), [(60, True), (0.2, False)])
def test_sigterm_lets_the_requests_in_flight_finish(vlm_path, timeout, finished):
    """``--shutdown-timeout``: an answer under way at SIGTERM arrives whole when it ends within
    the timeout, else it is cut; then the server exits with 0, refusing new connections and
    leaving no process."""
    args = ["--max-model-len", "512", "--shutdown-timeout", str(timeout)]
    server = RemoteServer(vlm_path, args)
    tokens = streamed_tokens_across_sigterm(server, 300)
    assert (tokens == 300) if finished else tokens is None
    assert server.proc.wait(60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=5)
    server.stop()
    assert_group_gone(server.proc.pid)
