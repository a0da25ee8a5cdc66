"""Multiprocessing contexts whose children never run the parent's main script again.

A "spawn" or "forkserver" child normally re-imports the parent's ``__main__`` (as
``__mp_main__``) before it unpickles its target, so that functions defined there can be found.
Our worker processes never need that (their targets live in mm_serve), and it breaks scripts:
a script without an ``if __name__ == "__main__":`` guard would run again in every child,
building another engine there and failing, since a process may not start children while it
bootstraps (a process pool then reports ``BrokenProcessPool``).

The processes of ``no_main_context(method)`` leave ``__main__`` alone: the preparation data
that describes the parent to the child (``multiprocessing.spawn.get_preparation_data``) omits
the main module for them, and only for them. Everything else the child is told (``sys.path``,
``sys.argv``, the working directory, the authkey) stays as the standard library sends it.

``group_members(pgid)``: the live processes of a process group, for whoever stops one (a server
started in its own session and the engine core and workers it started); ``free_port()``: a
port to start such a server on.
"""

from __future__ import annotations

import os
import socket
import threading
from multiprocessing import context, spawn
from pathlib import Path
from typing import Any

# How often a child process (engine core, TP worker) checks that its parent is still there.
PARENT_CHECK_INTERVAL_MS = 200

_MAIN_KEYS = ("init_main_from_name", "init_main_from_path")
_launching = threading.local()  # .active: this thread is starting one of our processes
_install_lock = threading.Lock()
_stdlib_get_preparation_data = spawn.get_preparation_data


def _get_preparation_data(name: str) -> dict[str, Any]:
    data = _stdlib_get_preparation_data(name)
    if getattr(_launching, "active", False):
        for key in _MAIN_KEYS:
            data.pop(key, None)
    return data


def _install() -> None:
    """Route ``get_preparation_data`` through ours (once); unchanged for other processes."""
    with _install_lock:
        if spawn.get_preparation_data is not _get_preparation_data:
            spawn.get_preparation_data = _get_preparation_data


def _without_main(popen: Any) -> Any:
    """A ``Process._Popen`` that starts the child without main-module preparation."""

    def _Popen(process_obj: Any) -> Any:  # noqa: N802 (multiprocessing's name)
        _install()
        _launching.active = True
        try:
            return popen(process_obj)
        finally:
            _launching.active = False

    return staticmethod(_Popen)


class _SpawnProcess(context.SpawnProcess):
    _Popen = _without_main(context.SpawnProcess._Popen)


class _ForkServerProcess(context.ForkServerProcess):
    _Popen = _without_main(context.ForkServerProcess._Popen)


class _SpawnContext(context.SpawnContext):
    Process = _SpawnProcess


class _ForkServerContext(context.ForkServerContext):
    Process = _ForkServerProcess


_CONTEXTS = {"spawn": _SpawnContext(), "forkserver": _ForkServerContext()}


def no_main_context(method: str) -> context.BaseContext:
    """The "spawn" or "forkserver" context whose processes do not re-import ``__main__``.

    Use it where ``multiprocessing.get_context(method)`` would go (``Process``, queues,
    ``ProcessPoolExecutor(mp_context=...)``). A child's target and arguments must then be
    importable from modules other than ``__main__``.

    Raises:
        ValueError: any other start method ("fork" never re-imports the main module).
    """
    if method not in _CONTEXTS:
        raise ValueError(f"No main-free context for {method!r}; use one of {sorted(_CONTEXTS)}.")
    return _CONTEXTS[method]


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


def free_port() -> int:
    """A TCP port free now on the loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
