"""Leak checks the tests run after every engine test: nothing held once all requests are done,
and nothing left behind once an engine core process is shut down."""

from __future__ import annotations

import os
from typing import Any

from mm_serve.engine.core import EngineCore


def assert_engine_idle(engine_core: EngineCore) -> None:
    """No request left, every KV block free, no encoder-cache entry referenced, and the runner
    holds no embeddings the encoder cache manager does not know of.

    Unreferenced encoder-cache entries may stay (they are the cache); they must be evictable.

    Raises:
        AssertionError: on any leak.
    """
    scheduler = engine_core.scheduler
    assert not scheduler.has_unfinished_requests()
    assert not scheduler.requests
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    encoder = scheduler.encoder_cache_manager
    assert all(not refs for refs in encoder.cached.values()), encoder.cached
    assert encoder.num_freeable_slots == encoder.cache_size
    held = getattr(engine_core.model_runner, "encoder_cache", None)  # in the TP workers: unseen
    if held is not None:
        assert held.keys() <= encoder.cached.keys() | set(encoder.freed)


def assert_llm_idle(llm: Any) -> None:
    """``assert_engine_idle`` on an ``LLM``'s in-process engine core; on one in its own process,
    what its counters show: no request, no KV block and no encoder-cache entry in use.

    Raises:
        AssertionError: on any leak.
    """
    if isinstance(llm.engine_core, EngineCore):
        assert_engine_idle(llm.engine_core)
        return
    assert not llm.engine_core.has_unfinished_requests()
    stats = llm.get_stats()
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0, stats
    assert stats.kv_cache_usage == 0 and stats.encoder_cache_usage == 0, stats


def process_gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaps yet (its parent is gone too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def shut_down_and_check(client: Any) -> None:
    """Shut an engine core client down twice (it is idempotent), then assert that the process
    is reaped, its ipc files and folder are gone and the client says it is dead.

    Raises:
        AssertionError: on any of those.
    """
    pid = client.pid
    client.shutdown()
    client.shutdown()
    assert process_gone(pid)
    assert not any(os.path.exists(p) for p in client.ipc_paths)
    assert not os.path.exists(os.path.dirname(client.ipc_paths[0]))
    assert client.is_dead
