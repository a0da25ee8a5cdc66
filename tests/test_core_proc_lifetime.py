"""The engine core process's life outside serving: a start-up error, a front end that fails
before sending its config, a parent that dies, and SIGTERM while idle. None leaves a process
or an ipc file behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from mm_serve.config import EngineArgs
from mm_serve.config.parallel import ParallelConfig
from mm_serve.frontend.async_llm import AsyncLLM
from mm_serve.frontend.core_client import EngineCoreClient
from mm_serve.frontend.exceptions import EngineStartupError
from tests.fixtures.leaks import process_gone, shut_down_and_check


@contextlib.contextmanager
def leaves_nothing(grace_s: float = 10.0):
    """Asserts that the block leaves no new child process and no new ipc folder. The folders
    are global to the machine: one that an earlier test's engine, still winding down on a
    slow machine, makes and removes meanwhile is waited out for ``grace_s`` seconds."""
    pattern = os.path.join(tempfile.gettempdir(), "mm_serve-*")
    before = set(glob.glob(pattern))
    children = set(multiprocessing.active_children())
    yield
    deadline = time.monotonic() + grace_s
    while not set(glob.glob(pattern)) <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert set(glob.glob(pattern)) <= before
    assert set(multiprocessing.active_children()) <= children


def test_startup_error_is_raised_and_leaves_nothing(vlm_path):
    config = EngineArgs(model=vlm_path).create_engine_config()
    config = dataclasses.replace(config, parallel=ParallelConfig(tensor_parallel_size=3))
    with leaves_nothing(), pytest.raises(EngineStartupError, match="tensor_parallel_size"):
        EngineCoreClient(config)


def test_engine_core_started_before_its_config_exits_without_one(vlm_path):
    """The client starts the process first (it imports while the front end resolves the
    config): if the front end fails before sending one, the process exits by itself, and a
    client shut down then leaves nothing."""
    with leaves_nothing():
        client = EngineCoreClient()
        assert client.engine_info is None and client._proc.is_alive()
        client._process.config_writer.close()  # what a front end that failed does
        client._proc.join(timeout=120)
        assert client._proc.exitcode == 0
        client.shutdown()

    client = EngineCoreClient()  # started, then given its config
    client.start(EngineArgs(model=vlm_path, num_kv_blocks=16).create_engine_config())
    assert client.engine_info.num_kv_blocks == 16
    shut_down_and_check(client)


def test_async_llm_failing_before_its_config_leaves_nothing(tmp_path):
    with leaves_nothing(), pytest.raises((ValueError, OSError)):
        AsyncLLM(EngineArgs(model=str(tmp_path / "no-such-model")))


ORPHAN_SCRIPT = """
import os, sys
from mm_serve.config import EngineArgs
from mm_serve.frontend.core_client import EngineCoreClient
if __name__ == "__main__":
    config = EngineArgs(model=sys.argv[1], num_kv_blocks=16).create_engine_config()
    client = EngineCoreClient(config)
    print(client.pid, client.ipc_paths[0], flush=True)
    os._exit(0)  # a crash: no shutdown, no exit handlers
"""


def test_engine_exits_when_its_parent_dies(llama_path, tmp_path):
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), llama_path], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    pid, ipc_path = out.stdout.split()
    deadline = time.monotonic() + 5.0
    while not process_gone(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_gone(int(pid))
    assert not os.path.exists(os.path.dirname(ipc_path))  # removed by the orphan itself


SIGTERM_SCRIPT = """
import signal, sys, threading, time
from mm_serve.engine import core_proc

class Idle:  # an engine core with nothing to do: the loop waits on its input queue
    def has_unfinished_requests(self):
        return False

if __name__ == "__main__":
    proc = core_proc.EngineCoreProc(f"ipc://{sys.argv[1]}/in", f"ipc://{sys.argv[1]}/out", None)
    proc.engine_core = Idle()
    signal.signal(signal.SIGTERM, core_proc._raise_system_exit)
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # may take the signal
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # as a library may leave it
    print("idle", flush=True)
    proc.run_busy_loop()
"""


def test_idle_engine_core_answers_sigterm_taken_by_another_thread(tmp_path):
    """SIGTERM that the kernel hands to another thread (the main thread masks it here; on
    CUDA the driver's threads are many) still stops an idle engine core: its main thread
    wakes to run the handler (``core_proc.IDLE_WAKEUP_S``) instead of waiting for ever."""
    script = tmp_path / "idle.py"
    script.write_text(SIGTERM_SCRIPT)
    child = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "idle"
        time.sleep(0.5)  # in its wait
        start = time.monotonic()
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=5) == 128 + signal.SIGTERM
        assert time.monotonic() - start < 2.0
    finally:
        child.kill()
        child.wait()
