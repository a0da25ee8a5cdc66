"""A real ``mm-serve serve`` subprocess on a free port, for integration tests and examples."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from mm_serve.client.images import image_to_url, user_message


def metric(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples over all labels in ``/metrics`` text (0 when
    absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group (read from /proc)."""
    members = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(stat[2]) == pgid and stat[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


def assert_group_gone(pgid: int, timeout_s: float = 5.0) -> None:
    """No process is left in the server's process group (they may take a moment to exit).

    Raises:
        AssertionError: with the pids still alive after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_members(pgid), f"processes left behind: {group_members(pgid)}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RemoteServer:
    """Starts ``python -m mm_serve.entrypoints.launch serve MODEL --port PORT *args`` (what the
    ``mm-serve`` console script runs) in its own process group and waits until ``/health``
    answers 200.

    Use as a context manager; on exit the whole process group is terminated (then killed), so
    no engine core or preprocessing worker outlives the test. ``stderr`` (a file) receives the
    server's log.

    Raises:
        RuntimeError: the server exited or was not healthy within ``startup_timeout_s``.
    """

    def __init__(
        self,
        model: str,
        args: list[str] | None = None,
        startup_timeout_s: float = 120,
        stderr: Any = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "mm_serve.entrypoints.launch", "serve", model]
        command += ["--host", "127.0.0.1", "--port", str(self.port), *(args or [])]
        self.proc = subprocess.Popen(command, stderr=stderr, start_new_session=True)
        self._wait_healthy(startup_timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"The server exited with code {self.proc.returncode}.")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"The server was not healthy within {timeout_s} s.")

    def stop(self, timeout_s: float = 10) -> int:
        """Terminate the server's process group; returns the server's exit code."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError):  # children left in the group (none)
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_checked(model: str, args: list[str]) -> Iterator[RemoteServer]:
    """The body of a pytest fixture (``yield from``): a started server, then, on teardown,
    the checks that it exited with 0 and left no process behind."""
    remote = RemoteServer(model, args)
    yield remote
    assert remote.stop() == 0
    assert_group_gone(remote.proc.pid)


def openai_client(model: str, args: list[str], name: str = "tiny-vlm") -> Iterator[Any]:
    """``serve_checked`` on ``model`` with ``args``, served as ``name``: yields an official
    ``openai.OpenAI`` client of it (no retries), for a pytest fixture."""
    import openai

    for server in serve_checked(model, [*args, "--served-model-name", name]):
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def http_client(model: str, args: list[str], timeout: float = 120) -> Iterator[httpx.Client]:
    """``serve_checked`` on ``model`` with ``args``: yields an ``httpx.Client`` of its base
    URL, for a pytest fixture."""
    for server in serve_checked(model, args):
        with httpx.Client(base_url=server.url, timeout=timeout) as client:
            yield client


def image_question(image_url: str, question: str = "What is in this picture?") -> list[dict]:
    """Chat messages: one user turn of an ``image_url`` part, then the question."""
    return [user_message(question, [image_url])]


def noise_png_url(seed: int, height: int, width: int) -> str:
    """A data URL of a PNG of uniform noise, ``height`` x ``width`` RGB pixels."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return image_to_url(Image.fromarray(pixels))
