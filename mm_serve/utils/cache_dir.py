"""Where mm_serve keeps what it compiles (imports nothing but the standard library, so that
the launcher reads it before torch is imported)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$MM_SERVE_CACHE_DIR``, default ``~/.cache/mm_serve``: Inductor's cache
    (``torch_compile/``) and, where the environment writes no bytecode, Python's (``pycache/``,
    ``entrypoints.launch``)."""
    return Path(os.environ.get("MM_SERVE_CACHE_DIR") or Path.home() / ".cache" / "mm_serve")
