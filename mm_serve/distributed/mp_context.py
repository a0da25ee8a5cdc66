"""Multiprocessing contexts whose children never run the parent's main script again.

A "spawn" or "forkserver" child re-imports the parent's ``__main__`` before unpickling its
target; a script without an ``if __name__ == "__main__":`` guard would then build another
engine in every child and fail (``BrokenProcessPool``). The processes of
``no_main_context(method)`` get preparation data (``multiprocessing.spawn.get_preparation_data``)
without the main module; the rest (``sys.path``, ``sys.argv``, working directory, authkey)
is as the standard library sends it.

``group_members(pgid)``: the live processes of a process group; ``free_port()``: a free port."""

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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now on ``host`` (default the loopback; ``""``: every interface)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
