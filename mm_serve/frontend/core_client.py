"""The front end's handle on the engine core process: start it, feed it, read it, watch it.

``AsyncEngineCoreClient`` serves the API server (asyncio); ``EngineCoreClient`` is the same
client with blocking calls and ``queue.Queue``s (tests, scripts). Both start the engine core
with "spawn" (never fork: the parent holds threads and maybe CUDA) on two ``ipc://`` sockets
in a fresh temporary folder and wait for its ``EngineReady`` (``engine_info``). One output
thread decodes the engine's messages and puts each request's outputs on that request's queue
(thread-safely, on the loop that added it); it also polls the process sentinel, so within
~0.1 s of the engine core dying every in-flight queue gets an ``EngineDeadError``,
``is_dead`` turns True and new calls raise.

A request's queue yields ``EngineCoreOutput``s until one is ``finished``, or one exception
instance after which nothing comes: ``EngineRequestError`` (refused: a 4xx unless ``kind`` is
"internal") or ``EngineDeadError`` (a 503; the server should exit).

The calls (``SyncCalls``: blocking; ``AsyncCalls``: coroutines) are written once over
``_add``, ``_abort``, ``_call`` and ``_call_each``, for one engine core and for the replicas
of a data-parallel front end (``dp_client``) alike.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import zmq

from mm_serve.config import EngineConfig
from mm_serve.frontend.engine_process import (
    POLL_INTERVAL_MS,
    ClientResources,
    EngineProcess,
    log_setup,
    start_engine_core,
)
from mm_serve.frontend.exceptions import EngineDeadError, EngineRequestError, EngineStartupError
from mm_serve.messages import wire
from mm_serve.messages.request import Request
from mm_serve.messages.stats import EngineStats


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

    async def get_kv_cache_info(self) -> wire.KVCacheInfo:
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


logger = logging.getLogger(__name__)


class EngineCoreClientBase:
    """Process, sockets and output thread, shared by the sync and the async client.

    The constructor starts the process (or takes over ``process``, which ``start_engine_core``
    started earlier); ``start(config)`` then sends it the engine config the
    front end resolved (the engine core does not resolve it again) and waits until it is ready,
    or the constructor does both when given ``config``. Started first, the process imports the
    engine while the front end resolves the config.

    Raises (from the constructor with ``config``, and from ``start``):
        EngineStartupError: the process failed or exited during start-up, or did not report
            ready within ``startup_timeout_s`` seconds (None: no limit).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        startup_timeout_s: float | None = None,
        process: EngineProcess | None = None,
    ) -> None:
        process = process or start_engine_core()
        self.ipc_paths = process.ipc_paths
        self._process, self._proc = process, process.proc
        self._ctx = zmq.Context()
        self._thread = threading.Thread(
            target=self._output_loop, name="mm_serve-engine-core-output", daemon=True
        )
        self._resources = ClientResources(process, self._thread, self._ctx)
        # Stop the child at exit, before multiprocessing's own exit hook would wait for it
        # forever: atexit runs hooks last-in first-out, and that one was registered when
        # multiprocessing.util was imported (by the process's start at the latest).
        atexit.register(self._resources.release)
        self._startup_timeout_s = startup_timeout_s
        self._lock = threading.Lock()  # guards the input socket, the codec and the tables
        self._codec = wire.InputCodec()
        self._sinks: dict[str, Sink] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._dead_error: EngineDeadError | None = None
        self._failure: wire.EngineFailed | None = None
        # Called once with the error when the engine core is found dead (a data-parallel
        # front end fails its other replicas with it).
        self.on_dead: Callable[[EngineDeadError], None] | None = None
        try:
            self._input = self._bind(zmq.PUSH, process.bind_addresses[0])
            self._output = self._bind(zmq.PULL, process.bind_addresses[1])
        except BaseException:
            self.shutdown()
            raise
        self.engine_info: wire.EngineReady | None = None
        if config is not None:
            self.start(config)

    def start(self, config: EngineConfig) -> None:
        """Send ``config`` to the engine core and wait until it is ready (``engine_info``).
        On failure the client is shut down and ``EngineStartupError`` raised."""
        self.send_config(config)
        self.wait_ready()

    def send_config(self, config: EngineConfig) -> None:
        """The first half of ``start``: the engine core starts building the engine."""
        endpoints = tuple(s.getsockopt(zmq.LAST_ENDPOINT).decode() for s in self._sockets)
        try:
            self._process.send_config(log_setup(), config, endpoints)
        except BaseException:
            self.shutdown()
            raise

    def wait_ready(self) -> None:
        """The second half of ``start``: wait for ``wire.EngineReady``, then read outputs."""
        try:
            self.engine_info = self._wait_ready(self._startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._thread.start()

    @property
    def _sockets(self) -> tuple[zmq.Socket, zmq.Socket]:
        return self._input, self._output

    def _bind(self, socket_type: int, address: str) -> zmq.Socket:
        socket = self._ctx.socket(socket_type)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM if socket_type == zmq.PUSH else zmq.RCVHWM, 0)
        self._resources.sockets += (socket,)
        socket.bind(address)
        return socket

    @property
    def pid(self) -> int | None:
        """The engine core process's pid."""
        return self._proc.pid

    @property
    def pids(self) -> list[int | None]:
        """The engine core processes' pids (one here; one per replica with data parallelism)."""
        return [self._proc.pid]

    @property
    def is_dead(self) -> bool:
        """True once the engine core process is gone (or was shut down): serve nothing more."""
        return self._dead_error is not None

    @property
    def num_in_flight(self) -> int:
        """Engine requests sent and not finished (aborted or failed): the engine core's
        waiting and running ones, as this client knows them."""
        return len(self._sinks)

    def holds(self, request_id: str) -> bool:
        """Whether ``request_id`` is in flight on this engine core."""
        return request_id in self._sinks

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine core (SIGTERM, SIGKILL after ``timeout_s``), wait for it, close the
        sockets and remove the ipc files. In-flight requests get ``EngineDeadError``.
        Idempotent."""
        atexit.unregister(self._resources.release)
        self._resources.release(timeout_s)
        self._mark_dead(EngineDeadError("The engine core was shut down."))

    # ---- start-up ----------------------------------------------------------------------

    def _wait_ready(self, timeout_s: float | None) -> wire.EngineReady:
        codec = wire.OutputCodec()
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self._proc.sentinel, zmq.POLLIN)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while deadline is None or time.monotonic() < deadline:
            events = dict(poller.poll(POLL_INTERVAL_MS))
            exited = self._proc.sentinel in events
            # A failing child sends EngineFailed, then exits: read the message first.
            if self._output in events or (exited and self._output.poll(500, zmq.POLLIN)):
                message = codec.decode(self._output.recv())
                if isinstance(message, wire.EngineReady):
                    return message
                if isinstance(message, wire.EngineFailed):
                    raise EngineStartupError(
                        f"The engine core failed to start: {message.message}\n{message.traceback}"
                    )
            elif exited:
                raise EngineStartupError(
                    f"The engine core process exited with code {self._proc.exitcode} during "
                    "start-up (see its log above)."
                )
        raise EngineStartupError(f"The engine core did not start within {timeout_s} s.")

    # ---- requests in -------------------------------------------------------------------

    def _add(self, requests: list[Request], sink: Sink, replica: int | None = None) -> None:
        """Send ``requests`` (one, or the siblings of an ``n > 1`` request) in one message.
        ``replica``: None or 0 (there is one engine core). Raises ValueError on an id already
        in flight."""
        if replica not in (None, 0):
            raise ValueError(f"data_parallel_rank {replica}: there is one engine core.")
        with self._lock:
            self._check_alive()
            for request in requests:
                if request.request_id in self._sinks:
                    raise ValueError(f"Request id {request.request_id!r} is already in flight.")
            self._send(self._codec.encode_request(*requests))
            for request in requests:
                self._sinks[request.request_id] = sink

    def _abort(self, request_ids: list[str]) -> None:
        """Abort requests; unknown or finished ids are ignored. Their queues get no error and
        no outputs but those already on their way."""
        with self._lock:
            for request_id in request_ids:
                self._sinks.pop(request_id, None)
            if self._dead_error is None:
                self._send(self._codec.encode(wire.AbortRequests(list(request_ids))))

    def _call(self, method: str) -> concurrent.futures.Future:
        """Send a utility call; the future gets the answering ``wire.EngineCoreOutputs``."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._check_alive()
            call_id = next(self._call_ids)
            self._send(self._codec.encode(wire.UtilityRequest(call_id, method)))
            self._calls[call_id] = future
        return future

    def _call_each(self, method: str) -> list[concurrent.futures.Future]:
        """``_call`` on each engine core: this one."""
        return [self._call(method)]

    def _check_alive(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(str(self._dead_error))

    def _send(self, frames: list[Any]) -> None:
        """Send without blocking on a dead engine (PUSH blocks while it has no peer)."""
        while True:
            try:
                self._input.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                if not self._proc.is_alive():
                    raise EngineDeadError("The engine core process is gone.") from None
                self._input.poll(POLL_INTERVAL_MS, zmq.POLLOUT)

    # ---- outputs out -------------------------------------------------------------------

    def _output_loop(self) -> None:
        codec = wire.OutputCodec()
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self._proc.sentinel, zmq.POLLIN)
        try:
            while not self._resources.closing.is_set():
                events = dict(poller.poll(POLL_INTERVAL_MS))
                if self._resources.closing.is_set():
                    return
                if self._output in events:
                    self._drain(codec)
                elif self._proc.sentinel in events:
                    self._output.poll(POLL_INTERVAL_MS, zmq.POLLIN)  # its last words, if any
                    self._drain(codec)
                    self._on_process_exit()
                    return
        except Exception:
            if not self._resources.closing.is_set():  # else: sockets closed by shutdown
                logger.exception("The engine core client's output thread failed")
                self._mark_dead(EngineDeadError("The engine core client's output thread failed."))

    def _drain(self, codec: wire.OutputCodec) -> None:
        while True:
            try:
                body = self._output.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            message = codec.decode(body.buffer)
            if isinstance(message, wire.EngineCoreOutputs):
                self._dispatch(message)
            elif isinstance(message, wire.EngineFailed):
                logger.error("The engine core failed: %s\n%s", message.message, message.traceback)
                self._failure = message

    def _dispatch(self, message: wire.EngineCoreOutputs) -> None:
        deliveries: list[tuple[Sink, Any]] = []
        with self._lock:
            for output in message.outputs:
                sink = self._sinks.get(output.request_id)
                if sink is None:
                    continue  # aborted meanwhile
                output.timestamp = message.timestamp
                if output.finished:
                    del self._sinks[output.request_id]
                deliveries.append((sink, output))
            for error in message.errors:
                sink = self._sinks.pop(error.request_id, None)
                if sink is not None:
                    exc = EngineRequestError(error.request_id, error.message, error.kind)
                    deliveries.append((sink, exc))
            future = self._calls.pop(message.call_id, None)
        deliver(deliveries)
        if future is not None and future.set_running_or_notify_cancel():
            if message.call_error is not None:
                future.set_exception(RuntimeError(message.call_error))
            else:
                future.set_result(message)

    def _on_process_exit(self) -> None:
        reason = f"The engine core process (pid {self.pid}) exited with code {self._proc.exitcode}"
        if self._failure is not None:
            reason += f" after an error: {self._failure.message}"
        logger.error("%s.", reason)
        self._mark_dead(EngineDeadError(reason + "."))

    def _mark_dead(self, error: EngineDeadError) -> None:
        """Fail every in-flight request and call with (a copy of) ``error``; once."""
        with self._lock:
            if self._dead_error is not None:
                return
            self._dead_error = error
            sinks, self._sinks = list(self._sinks.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        deliver([(sink, EngineDeadError(str(error))) for sink in sinks])
        for future in calls:
            if future.set_running_or_notify_cancel():  # False: the caller gave up on it
                future.set_exception(EngineDeadError(str(error)))
        if self.on_dead is not None:
            self.on_dead(error)


class EngineCoreClient(SyncCalls, EngineCoreClientBase):
    """Blocking client: ``add_requests`` returns the requests' ``queue.Queue`` (see module doc).

    Raises:
        EngineStartupError: from the constructor, see ``EngineCoreClientBase``.
        EngineDeadError: from any call once the engine core is gone.
    """


class AsyncEngineCoreClient(AsyncCalls, EngineCoreClientBase):
    """The API server's client: coroutine calls, an ``asyncio.Queue`` per user request.

    The constructor blocks until the engine core is ready (seconds to minutes: the model
    loads); from a running loop, build it with ``await asyncio.to_thread(...)``. Requests may
    come from several event loops; each request's queue is fed on the loop that added it.

    Raises:
        EngineStartupError: from the constructor, see ``EngineCoreClientBase``.
        EngineDeadError: from any call once the engine core is gone.
    """
