"""The command line's logging setup, shared by every process ``mm-serve`` starts."""

from __future__ import annotations

import logging


def configure_logging(level_name: str) -> None:
    """Log at ``level_name`` (debug, info, warning, error, critical) from mm_serve's loggers;
    other libraries' stay at WARNING or above: --log-level debug is about ours."""
    level = logging.getLevelName(level_name.upper())
    logging.basicConfig(
        level=max(level, logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("mm_serve").setLevel(level)
