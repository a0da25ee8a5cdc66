"""Handing outputs from the client's output thread to the requests' queues.

A request's outputs go to a ``queue.Queue`` (the blocking client) or to an ``asyncio.Queue``
owned by an event loop (the async client). The output thread never touches an asyncio queue
itself: it schedules one ``call_soon_threadsafe`` per loop and batch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from typing import Any, NamedTuple


class Sink(NamedTuple):
    """Where one request's outputs go: a queue, and the event loop that owns it (or None)."""

    queue: Any  # queue.Queue or asyncio.Queue
    loop: asyncio.AbstractEventLoop | None


def deliver(deliveries: list[tuple[Sink, Any]]) -> None:
    """Put each item on its queue: directly for a sync queue, else one wake-up per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = defaultdict(list)
    for sink, item in deliveries:
        if sink.loop is None:
            sink.queue.put_nowait(item)
        else:
            by_loop[sink.loop].append((sink.queue, item))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)
