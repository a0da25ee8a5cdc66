"""The engine core process as its client starts and stops it.

``start_engine_core`` starts the process: "spawn" (never fork: the parent holds threads and
maybe CUDA), without re-running the user's main script (``mp_context``), with a target that
imports the engine core in the child only, so that the front end never loads the scheduler,
the model runner or the models. It needs neither torch nor the config: ``mm-serve serve``
starts it before anything else, so that it imports the engine (seconds) while the API server
imports the web stack and resolves the config. ``ClientResources`` is what a client must
release. With several API-server processes (``--api-server-count``) the process serves one
client per API server, each on its own pair of sockets (``shared_engine.client_views``).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import zmq

from mm_serve.distributed.mp_context import no_main_context

logger = logging.getLogger(__name__)

POLL_INTERVAL_MS = 100  # the output thread's wake-up period (it notices shutdown within this)


def log_setup() -> tuple[str, int, int] | None:
    """(format, root level, ``mm_serve`` level) of this process's logging, for an engine core
    it starts to log alike; None when logging is not configured (a script stays quiet)."""
    root = logging.getLogger()
    if not root.handlers:
        return None
    fmt = getattr(root.handlers[0].formatter, "_fmt", None) or logging.BASIC_FORMAT
    return fmt, root.level, logging.getLogger("mm_serve").getEffectiveLevel()


def _run_engine_core(*args: Any) -> None:
    """The engine core process's target: ``run_engine_core`` is imported there only."""
    from mm_serve.engine.core_proc import run_engine_core

    run_engine_core(*args)


@dataclass
class EngineProcess:
    """A started engine core process, waiting for its config.

    ``client_ipc_paths``: per client, the (input, output) socket files in the fresh folder
    ``ipc_dir``, which the client binds and the process connects to (ZeroMQ retries until
    they are bound); ``ipc_paths`` are client 0's. ``config_writer``: the pipe end on which
    the client sends ``(log_setup(), EngineConfig)``, pickled; closing it unsent makes the
    process exit with code 0.
    """

    proc: BaseProcess
    ipc_dir: str
    client_ipc_paths: list[tuple[str, str]]
    config_writer: Connection

    @property
    def ipc_paths(self) -> tuple[str, str]:
        """Client 0's (input, output) socket files."""
        return self.client_ipc_paths[0]

    @property
    def num_clients(self) -> int:
        return len(self.client_ipc_paths)

    @property
    def bind_addresses(self) -> tuple[str, str]:
        """The (input, output) ZeroMQ addresses the client binds."""
        return f"ipc://{self.ipc_paths[0]}", f"ipc://{self.ipc_paths[1]}"

    def send_config(self, setup: Any, config: Any, endpoints: tuple[str, str]) -> None:
        """Send the logging set-up and the ``EngineConfig``; the process, which knows the
        ``endpoints`` since it started, then builds the engine."""
        self.config_writer.send((setup, config))
        self.config_writer.close()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close the pipe (a process still waiting for its config exits), then SIGTERM, SIGKILL
        after ``timeout_s``; remove the ipc folder. Safe to repeat."""
        self.config_writer.close()
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout_s)
        if self.proc.is_alive():
            logger.warning("The engine core (pid %d) ignored SIGTERM; killing it.", self.proc.pid)
            self.proc.kill()
        self.proc.join()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def start_engine_core(num_clients: int = 1) -> EngineProcess:
    """Start the engine core process, serving ``num_clients`` clients (API-server processes);
    the engine core does not resolve the config again."""
    ipc_dir = tempfile.mkdtemp(prefix="mm_serve-")
    tag = uuid.uuid4().hex[:12]
    paths = [
        (f"{ipc_dir}/input-{tag}-{i}.sock", f"{ipc_dir}/output-{tag}-{i}.sock")
        for i in range(num_clients)
    ]
    context = no_main_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    inputs, outputs = ([f"ipc://{pair[k]}" for pair in paths] for k in (0, 1))
    process = context.Process(
        target=_run_engine_core,
        args=(reader, inputs, outputs, os.getpid()),
        name="mm_serve-engine-core",
    )
    process.start()
    reader.close()  # the child's end
    return EngineProcess(process, ipc_dir, paths, writer)


@dataclass
class ClientResources:
    """What the client must release; apart from it, so that the atexit hook does not hold it."""

    process: EngineProcess
    thread: threading.Thread  # the output thread
    ctx: zmq.Context
    sockets: tuple[zmq.Socket, ...] = ()
    closing: threading.Event = field(default_factory=threading.Event)

    def release(self, timeout_s: float = 5.0) -> None:
        """Stop the process (``EngineProcess.stop``), the output thread and the sockets. Safe
        to repeat."""
        self.closing.set()
        self.process.stop(timeout_s)
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=2 * POLL_INTERVAL_MS / 1000 + 1)
        for socket in self.sockets:
            socket.close(linger=0)
        self.ctx.term()
