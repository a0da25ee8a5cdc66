"""A clean shutdown of ``mm-serve serve`` prints no finalization noise (Triton's nanobind
"leaked" lines), and a failing process keeps its standard error."""

from __future__ import annotations

import subprocess
import sys

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
