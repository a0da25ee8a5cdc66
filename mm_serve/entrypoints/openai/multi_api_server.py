"""Several API-server processes in front of one engine core (vLLM's ``--api-server-count``).

The main process binds the listening socket once, starts the engine core for N clients
(``start_engine_core(N)``) and N API-server processes ("spawn"), each handed the socket, its
client view of the engine core (``frontend.shared_engine``: its own pair of ZeroMQ sockets,
so that the engine core sends each request's outputs back to the process that owns it) and
the shared ``PROMETHEUS_MULTIPROC_DIR`` (``/metrics`` on any of them shows the whole
server's counts). Each runs ``run_server``: tokenizing, preprocessing, detokenizing and HTTP
in its own interpreter, while the kernel spreads the connections over their ``accept``s.

API server 0 sends the engine its config and warms it up; the others warm up their own
preprocessing, then wait for it before serving (the engine's reset after warm-up needs it
idle). Lifetime: the main process waits on every child; when any of them exits (an API
server killed, the engine core died), it stops the rest at once and returns 1; on SIGTERM /
SIGINT it passes SIGTERM on, waits for the API servers to drain, stops the engine core and
returns 0. An API server dies with the main process (``PR_SET_PDEATHSIG``); the engine core watches
its parent itself.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from mm_serve.config import EngineArgs
from mm_serve.distributed.mp_context import no_main_context
from mm_serve.frontend.engine_process import EngineProcess, start_engine_core
from mm_serve.frontend.shared_engine import SharedEngineProcess, client_views

if TYPE_CHECKING:
    from fastapi import FastAPI

    from mm_serve.entrypoints.openai.api_server import ServerConfig
    from mm_serve.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client's
SERVED_BY_HEADER = "x-mm-serve-pid"  # the pid of the API server that answered
WARM_WAIT_S = 0.5  # how often a waiting API server checks that the engine core still lives
STOP_GRACE_S = 5.0  # beyond the drain time, before a stuck API server is killed
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass
class ApiServerRole:
    """API-server process ``index``'s part in a server of several (picklable: the main
    process hands it over at spawn).

    ``listener``: the shared listening socket; ``engine``: this process's view of the engine
    core; ``metrics_dir``: the shared multiprocess metrics folder; ``engine_warmed``: a pipe
    that API server 0 (holding the write end) closes once the engine core is warmed up and
    reset, and the others (each holding a read end) then see at its end; ``parent_pid``: the
    main process.
    """

    index: int
    listener: socket.socket
    engine: SharedEngineProcess
    metrics_dir: str
    engine_warmed: Connection
    parent_pid: int

    async def warm_up(self, llm: AsyncLLM) -> None:
        """API server 0: warm the engine core up (``AsyncLLM.warm_up``) and tell the others.
        The others: warm up their preprocessing only, then wait for API server 0 (or for the
        engine core's death, which the server then reports), so that none of their requests
        runs while the engine core resets."""
        if self.index == 0:
            await llm.warm_up()
            self.engine_warmed.close()
            return
        await llm.warm_up(through_engine=False)
        warmed = self.engine_warmed.poll  # True at the pipe's end
        while not llm.is_dead and not await asyncio.to_thread(warmed, WARM_WAIT_S):
            pass

    def add_served_by_header(self, app: FastAPI) -> None:
        """Every HTTP response names this API server's pid (``SERVED_BY_HEADER``)."""
        app.add_middleware(_ServedBy, value=str(os.getpid()).encode())


class _ServedBy:
    """ASGI middleware: adds ``SERVED_BY_HEADER: value`` to each HTTP response."""

    def __init__(self, app: Any, value: bytes) -> None:
        self.app, self.header = app, (SERVED_BY_HEADER.encode(), value)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (IPv6 when ``host`` has a colon).

    Raises:
        OSError: the address is in use or not this host's.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        listener.listen(2048)  # uvicorn's default backlog
    except OSError:
        listener.close()
        raise
    return listener


def check_supported(engine_args: EngineArgs, count: int) -> None:
    """Raises ValueError for a count below 1, or several API servers with data parallelism
    or Ray engine cores (each API server would need every replica's sockets)."""
    if count < 1:
        raise ValueError(f"--api-server-count must be at least 1, not {count}.")
    if count > 1 and (
        engine_args.data_parallel_size > 1 or engine_args.data_parallel_backend != "mp"
    ):
        raise ValueError(
            "--api-server-count above 1 needs one local engine core (--data-parallel-size 1, "
            "--data-parallel-backend mp)."
        )


def run_multi_api_server(
    engine_args: EngineArgs, config: ServerConfig, engine_process: EngineProcess | None
) -> int:
    """Serve with ``config.api_server_count`` API-server processes until stopped; returns
    the exit code (0 after SIGTERM / SIGINT, 1 when a process of the server died).
    ``engine_process``: started already (the launcher's); replaced when it was started for
    another number of clients.

    Raises:
        ValueError: an unsupported combination (``check_supported``).
        OSError: the listening address cannot be bound.
    """
    count = config.api_server_count
    check_supported(engine_args, count)
    if engine_process is None or engine_process.num_clients != count:
        if engine_process is not None:
            engine_process.stop()
        engine_process = start_engine_core(count)
    servers: list[BaseProcess] = []
    metrics_dir = tempfile.mkdtemp(prefix="mm_serve-metrics-")
    os.environ[MULTIPROC_DIR_ENV] = metrics_dir  # the children import prometheus-client
    try:
        servers = start_api_servers(engine_args, config, engine_process, metrics_dir)
        return supervise(servers, engine_process.proc, config.shutdown_timeout)
    finally:  # the API servers drained already, or the server is failing: stop all at once
        stop_processes([*servers, engine_process.proc], config.shutdown_timeout + STOP_GRACE_S)
        engine_process.stop()  # its pipe and ipc files
        shutil.rmtree(metrics_dir, ignore_errors=True)


def start_api_servers(
    engine_args: EngineArgs,
    config: ServerConfig,
    engine: EngineProcess,
    metrics_dir: str,
) -> list[BaseProcess]:
    """Start one API-server process per client of ``engine``, on one listening socket."""
    listener = bind_listener(config.host, config.port)
    context = no_main_context("spawn")
    warmed_reader, warmed_writer = context.Pipe(duplex=False)
    servers = []
    try:
        for view in client_views(engine):
            warmed = warmed_writer if view.index == 0 else warmed_reader
            role = ApiServerRole(view.index, listener, view, metrics_dir, warmed, os.getpid())
            server = context.Process(
                target=run_api_server_process,
                args=(role, engine_args, config),
                name=f"mm_serve-api-server-{view.index}",
            )
            server.start()
            servers.append(server)
    except BaseException:
        stop_processes(servers, STOP_GRACE_S)
        raise
    finally:  # the API servers hold their own copies
        for end in (listener, engine.config_writer, warmed_reader, warmed_writer):
            end.close()
    logger.info("Started %d API servers (pids %s)", len(servers), [s.pid for s in servers])
    return servers


def supervise(servers: list[BaseProcess], engine: BaseProcess, drain_timeout_s: float) -> int:
    """Wait until an API server or the engine core exits (returns 1) or SIGTERM / SIGINT
    (passed on to the API servers as SIGTERM; returns 0 once they exited)."""
    stop_signals: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        stop_signals.append(signum)
        for server in servers:
            if server.is_alive():
                os.kill(server.pid, signal.SIGTERM)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    processes = {p.sentinel: p for p in [*servers, engine]}
    (first, *_) = multiprocessing.connection.wait(list(processes))
    if stop_signals:
        multiprocessing.connection.wait([s.sentinel for s in servers], drain_timeout_s)
        return 0
    gone = processes[first]
    gone.join()
    logger.error(
        "%s (pid %d) exited with code %s; stopping the server.", gone.name, gone.pid, gone.exitcode
    )
    return 1


def stop_processes(processes: list[BaseProcess], timeout_s: float) -> None:
    """SIGTERM each live process, wait up to ``timeout_s`` for all, then SIGKILL the rest."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            logger.warning("%s (pid %d) ignored SIGTERM; killing it.", process.name, process.pid)
            process.kill()
        process.join()


def run_api_server_process(role: ApiServerRole, engine_args: EngineArgs, config: Any) -> None:
    """Target of an API-server process: ``run_server`` on the shared socket; exits with its
    code (1 when the engine could not start)."""
    from mm_serve.entrypoints.openai.api_server import run_server
    from mm_serve.frontend.exceptions import EngineStartupError
    from mm_serve.utils import quiet_exit
    from mm_serve.utils.logs import configure_logging

    quiet_exit.install()
    _exit_with_parent(role.parent_pid)
    configure_logging(config.log_level)
    try:
        exit_code = asyncio.run(run_server(engine_args, config, role=role))
    except (ValueError, EngineStartupError) as e:
        logger.error("API server %d cannot serve: %s", role.index, e)
        exit_code = 1
    if exit_code == 0:
        quiet_exit.mark_clean()
    sys.exit(exit_code)


def _exit_with_parent(parent_pid: int) -> None:
    """Get SIGTERM when the main process dies (Linux), and exit now if it is gone already."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
        sys.exit(1)
