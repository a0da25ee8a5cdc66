"""Capturing a CUDA graph without stopping the engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture_graph(graph: torch.cuda.CUDAGraph, pool, fn: Callable[[], T]) -> T:
    """Capture ``fn()`` into ``graph`` (memory from ``pool``) on a side stream; returns its
    result, whose memory the graph owns.

    ``torch.cuda.graph`` does the same but first synchronises the device and empties both
    caching allocators (device and pinned host), which mid-run makes the next steps allocate
    afresh; here nothing is synchronised or freed, so a graph can be captured while serving.
    Only this thread is checked for unsafe calls (``thread_local``): the engine's other
    threads may keep working.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            result = fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return result
