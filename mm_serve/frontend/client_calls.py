"""The calls of the engine core clients, over their ``_add``, ``_abort``, ``_call`` and
``_call_each``: blocking (``SyncCalls``: ``EngineCoreClient``, ``DataParallelClient``) or
coroutines (``AsyncCalls``: ``AsyncEngineCoreClient``, ``AsyncDataParallelClient``), the same
for one engine core and for the replicas of a data-parallel front end."""

from __future__ import annotations

import asyncio
import queue

from mm_serve.frontend.delivery import Sink
from mm_serve.messages.request import Request
from mm_serve.messages.stats import EngineStats
from mm_serve.messages.wire import KVCacheInfo


class SyncCalls:
    """The blocking client's calls, over ``_add``, ``_abort`` and ``_call`` (those of one
    engine core, or of the data-parallel front end's replicas)."""

    def add_requests(
        self,
        requests: list[Request],
        output_queue: queue.Queue | None = None,
        data_parallel_rank: int | None = None,
    ) -> queue.Queue:
        """Send the ``n`` sibling requests of one user request (they share the prompt and
        images, which are sent once) to the engine core; their outputs go to ``output_queue``
        (which several requests may share: each output names its request) or to a new queue.
        ``data_parallel_rank``: the replica to run them (None: the router's choice).
        Returns the queue. Raises ValueError on an id already in flight, or requests that are
        no siblings (``messages.requests_to_wire``)."""
        sink = Sink(queue.Queue() if output_queue is None else output_queue, None)
        self._add(requests, sink, data_parallel_rank)
        return sink.queue

    def abort_requests(self, request_ids: list[str]) -> None:
        self._abort(request_ids)

    def get_stats(self, timeout_s: float | None = 30.0) -> EngineStats:
        """The engine's counters (``mm_serve.messages.stats.EngineStats``), after all earlier
        inputs."""
        return self._call("get_stats").result(timeout_s).stats

    def get_replica_stats(self, timeout_s: float | None = 30.0) -> list[EngineStats]:
        """Each engine core replica's counters (one without data parallelism)."""
        return [future.result(timeout_s).stats for future in self._call_each("get_stats")]

    def reset(self, timeout_s: float | None = 60.0) -> None:
        """``EngineCore.reset`` once all earlier inputs took effect. Raises RuntimeError while
        requests are unfinished."""
        self._call("reset").result(timeout_s)

    def start_profile(self, timeout_s: float | None = 60.0) -> None:
        """``EngineCore.start_profile`` in the engine core process (each replica's). Raises
        RuntimeError as it does."""
        self._call("start_profile").result(timeout_s)

    def stop_profile(self, timeout_s: float | None = 300.0) -> None:
        """``EngineCore.stop_profile`` (writing the traces takes a while). Raises RuntimeError
        as it does."""
        self._call("stop_profile").result(timeout_s)


class AsyncCalls:
    """The async client's calls, over ``_add``, ``_abort`` and ``_call`` (as ``SyncCalls``)."""

    async def add_request(self, request: Request) -> asyncio.Queue:
        """Send ``request``; returns its queue. Raises ValueError on an id already in flight."""
        return await self.add_requests([request])

    async def add_requests(
        self, requests: list[Request], data_parallel_rank: int | None = None
    ) -> asyncio.Queue:
        """Send the ``n`` sibling requests of one user request (they share the prompt and
        images, which are sent once); returns their one queue, where each output names its
        request. ``data_parallel_rank``: the replica to run them (None: the router's choice).
        Raises ValueError as ``EngineCoreClient.add_requests``."""
        sink = Sink(asyncio.Queue(), asyncio.get_running_loop())
        self._add(requests, sink, data_parallel_rank)
        return sink.queue

    async def abort_requests(self, request_ids: list[str]) -> None:
        self._abort(request_ids)

    async def get_stats(self) -> EngineStats:
        """The engine's counters (``mm_serve.messages.stats.EngineStats``), after all earlier
        inputs."""
        return (await asyncio.wrap_future(self._call("get_stats"))).stats

    async def get_replica_stats(self) -> list[EngineStats]:
        """Each engine core replica's counters (one without data parallelism)."""
        futures = [asyncio.wrap_future(f) for f in self._call_each("get_stats")]
        return [answer.stats for answer in await asyncio.gather(*futures)]

    async def get_kv_cache_info(self) -> KVCacheInfo:
        """KV pool size and free blocks, after all earlier inputs (e.g. an abort) took effect."""
        return (await asyncio.wrap_future(self._call("get_stats"))).kv_cache

    async def reset(self) -> None:
        """``EngineCore.reset`` once all earlier inputs took effect. Raises RuntimeError while
        requests are unfinished."""
        await asyncio.wrap_future(self._call("reset"))

    async def start_profile(self) -> None:
        """``EngineCore.start_profile`` (each replica's). Raises RuntimeError as it does."""
        await asyncio.wrap_future(self._call("start_profile"))

    async def stop_profile(self) -> None:
        """``EngineCore.stop_profile`` (each replica's). Raises RuntimeError as it does."""
        await asyncio.wrap_future(self._call("stop_profile"))
