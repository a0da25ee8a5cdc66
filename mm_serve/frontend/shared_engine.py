"""An API-server process's view of the one engine core that several API servers share.

With ``--api-server-count N`` the server's main process starts the engine core
(``start_engine_core(N)``) and N API-server processes; each of them runs an ``AsyncLLM`` whose
client binds its own pair of sockets (client ``index``) and watches the engine core, a process
it did not start, through a pidfd. ``SharedEngineProcess`` is what ``EngineProcess`` is to
that client: API server 0 sends the config (it holds the pipe); stopping it stops nothing,
since the main process owns the engine core.
"""

from __future__ import annotations

import functools
import os
import select
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from mm_serve.frontend.engine_process import EngineProcess


class PeerProcess:
    """The part of ``multiprocessing``'s process handle that the client uses, for a process
    that this one did not start: ``sentinel`` (a pidfd, readable once the process ended),
    ``is_alive()``, ``pid``; ``exitcode`` is unknown (None).

    Raises:
        ProcessLookupError: from the constructor, when ``pid`` is gone already.
    """

    exitcode = None

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sentinel = os.pidfd_open(pid)

    def is_alive(self) -> bool:
        readable, _, _ = select.select([self.sentinel], [], [], 0)
        return not readable


@dataclass
class SharedEngineProcess:
    """Client ``index``'s view of the shared engine core (built in the main process, used in
    an API-server process): the engine core's ``pid``, this client's (input, output) socket
    files ``ipc_paths``, and the config pipe for client 0 (None for the others)."""

    pid: int
    index: int
    ipc_paths: tuple[str, str]
    config_writer: Connection | None

    @functools.cached_property
    def proc(self) -> PeerProcess:
        return PeerProcess(self.pid)  # opened where it is used, not where it was pickled

    @property
    def bind_addresses(self) -> tuple[str, str]:
        return f"ipc://{self.ipc_paths[0]}", f"ipc://{self.ipc_paths[1]}"

    def send_config(self, setup: Any, config: Any, endpoints: tuple[str, str]) -> None:
        """Client 0 sends the config, as a lone client does; the others have nothing to send."""
        if self.config_writer is not None:
            self.config_writer.send((setup, config))
            self.config_writer.close()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close the pipe; the engine core is the main process's to stop."""
        if self.config_writer is not None:
            self.config_writer.close()


def client_views(process: EngineProcess) -> list[SharedEngineProcess]:
    """Each client's view of ``process`` (started with ``start_engine_core(num_clients)``)."""
    return [
        SharedEngineProcess(process.proc.pid, i, paths, process.config_writer if i == 0 else None)
        for i, paths in enumerate(process.client_ipc_paths)
    ]
