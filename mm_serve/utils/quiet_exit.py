"""A process that ends cleanly says nothing more: what extension modules print while the
interpreter finalizes (Triton's nanobind bindings list their "leaked" objects, some 30 lines)
is dropped.

``install()``, first thing in a process, registers an exit handler that, being the first
registered, runs after every other one; ``mark_clean()`` when the process's work ended well.
The handler then points standard error at ``/dev/null`` for the rest of finalization. A
process that fails (no ``mark_clean``) keeps its standard error, tracebacks and all.
"""

from __future__ import annotations

import atexit
import os
import sys

_state = {"installed": False, "clean": False}


def install() -> None:
    """Register the exit handler (once per process)."""
    if not _state["installed"]:
        _state["installed"] = True
        atexit.register(_silence_if_clean)


def mark_clean() -> None:
    """The process's work ended well: finalization may not print."""
    _state["clean"] = True


def _silence_if_clean() -> None:
    if not _state["clean"]:
        return
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stderr.fileno())
    os.close(devnull)
