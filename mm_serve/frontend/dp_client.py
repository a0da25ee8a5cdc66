"""Data parallelism: one front end, several engine core replicas.

Each replica is a whole engine core (scheduler, KV cache, encoder cache, its tensor-parallel
workers) in its own process, or Ray actor (``frontend/ray_engine.py``), behind its own
``EngineCoreClientBase`` (its sockets and output thread): the ZeroMQ wire of one engine core,
once per replica. ``DataParallelClient`` / ``AsyncDataParallelClient`` have the calls of
``EngineCoreClient`` / ``AsyncEngineCoreClient``: a request goes to the replica that the
``ReplicaRouter`` picks (load and cache affinity, ``frontend/dp_router.py``), or to the one
named by ``data_parallel_rank``; an abort goes to the replica that holds the request; its
outputs come back on that replica's output thread to the request's own queue, as with one
engine core. The counters are summed over the replicas (``get_stats``) or kept apart
(``get_replica_stats``, the server's per-replica metrics). When one replica dies, every
replica's in-flight requests fail with ``EngineDeadError`` and ``is_dead`` turns True: the
server stops, as it does when its one engine core dies.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from mm_serve.config import EngineArgs, EngineConfig
from mm_serve.config.parallel import ParallelConfig
from mm_serve.frontend.core_client import (
    AsyncCalls,
    AsyncEngineCoreClient,
    EngineCoreClient,
    EngineCoreClientBase,
    Sink,
    SyncCalls,
)
from mm_serve.frontend.dp_router import ReplicaRouter
from mm_serve.frontend.engine_process import EngineProcess, start_engine_core
from mm_serve.frontend.exceptions import EngineDeadError
from mm_serve.messages.request import Request
from mm_serve.messages.stats import combine_stats
from mm_serve.messages.wire import EngineCoreOutputs, KVCacheInfo

logger = logging.getLogger(__name__)


def replica_config(config: EngineConfig, rank: int) -> EngineConfig:
    """``config`` for replica ``rank``: its ``data_parallel_rank`` and, on CUDA with local
    replicas, its first device (``cuda:rank * tensor_parallel_size``; its TP ranks take the
    next ones). A Ray actor sees only its own GPUs, from ``cuda:0``."""
    parallel = dataclasses.replace(config.parallel, data_parallel_rank=rank)
    device = config.device
    if device.type == "cuda" and parallel.data_parallel_backend == "mp":
        device = torch.device("cuda", (device.index or 0) + rank * parallel.tensor_parallel_size)
    return dataclasses.replace(config, parallel=parallel, device=device)


def max_imbalance(config: EngineConfig) -> int:
    """How many more requests than the least loaded replica an affine one may hold and still
    get a request for its cache: an eighth of ``max_num_seqs`` (at least 1). Requests below
    the batch limit run together, so a few more cost a replica little, while a miss
    recomputes the images and the prefix."""
    return max(1, config.scheduler.max_num_seqs // 8)


def _gather(
    futures: list[concurrent.futures.Future], combine: Callable[[list[Any]], Any]
) -> concurrent.futures.Future:
    """A future of ``combine`` over the results of ``futures``, or the first one's error."""
    result: concurrent.futures.Future = concurrent.futures.Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def on_done(_: concurrent.futures.Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        if result.set_running_or_notify_cancel():
            try:
                result.set_result(combine([future.result() for future in futures]))
            except BaseException as e:
                result.set_exception(e)

    for future in futures:
        future.add_done_callback(on_done)
    return result


def _combine_outputs(answers: list[EngineCoreOutputs]) -> EngineCoreOutputs:
    """One utility answer of the replicas' (``get_stats``: summed counters and KV pools)."""
    if answers[0].stats is None:
        return EngineCoreOutputs()
    stats = combine_stats([answer.stats for answer in answers])
    pools = [answer.kv_cache for answer in answers]
    kv_cache = KVCacheInfo(
        sum(pool.num_blocks for pool in pools),
        sum(pool.num_free_blocks for pool in pools),
        pools[0].block_size,
    )
    return EngineCoreOutputs(stats=stats, kv_cache=kv_cache)


class DataParallelClientBase:
    """The replicas' clients (not started) and the router; ``start(config)`` starts them all.

    Raises (from ``start``):
        EngineStartupError: a replica failed to start (all are shut down).
    """

    def __init__(self, clients: list[EngineCoreClientBase]) -> None:
        self.clients = clients
        self.router: ReplicaRouter | None = None
        self._lock = threading.Lock()
        self._closing = False  # shutting down, or a replica died: the rest follow
        for rank, client in enumerate(clients):
            client.on_dead = functools.partial(self._replica_died, rank)

    def start(self, config: EngineConfig) -> None:
        """Send every replica its config (they build their engines at once), then wait until
        each is ready."""
        self.router = ReplicaRouter(
            len(self.clients), config.cache.block_size, max_imbalance(config)
        )
        try:
            for rank, client in enumerate(self.clients):
                client.send_config(replica_config(config, rank))
            for client in self.clients:
                client.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d data-parallel engine cores are ready", len(self.clients))

    @property
    def engine_info(self):
        return self.clients[0].engine_info

    @property
    def pid(self) -> int | None:
        """The first replica's engine core pid."""
        return self.clients[0].pid

    @property
    def pids(self) -> list[int | None]:
        return [client.pid for client in self.clients]

    @property
    def is_dead(self) -> bool:
        """True once any replica is gone (then all are marked dead)."""
        return any(client.is_dead for client in self.clients)

    def loads(self) -> list[int]:
        """Each replica's engine requests in flight (sent, not finished)."""
        return [client.num_in_flight for client in self.clients]

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every replica (see ``EngineCoreClientBase.shutdown``). Idempotent."""
        self._closing = True
        for client in self.clients:
            client.shutdown(timeout_s)

    def _replica_died(self, rank: int, error: EngineDeadError) -> None:
        """The first replica found dead (or shut down) takes the others down with it."""
        with self._lock:
            first, self._closing = not self._closing, True
        if not first:
            return
        logger.error("Data-parallel replica %d is gone; the others stop serving.", rank)
        for client in self.clients:
            client._mark_dead(EngineDeadError(f"Data-parallel replica {rank}: {error}"))

    def _add(self, requests: list[Request], sink: Sink, replica: int | None = None) -> None:
        """Send ``requests`` to ``replica`` (None: the router's choice). Raises ValueError on
        a replica out of range or an id already in flight."""
        with self._lock:
            if self.is_dead:
                raise EngineDeadError("A data-parallel engine core replica is gone.")
            if replica is None:
                replica = self.router.route(requests, self.loads())
            elif not 0 <= replica < len(self.clients):
                raise ValueError(f"data_parallel_rank {replica} is not a replica.")
            else:
                self.router.pin(requests, replica)
            self.clients[replica]._add(requests, sink)

    def _abort(self, request_ids: list[str]) -> None:
        """Abort each request at the replica that holds it; unknown or finished ids are
        ignored."""
        for client in self.clients:
            held = [request_id for request_id in request_ids if client.holds(request_id)]
            if held:
                client._abort(held)

    def _call(self, method: str) -> concurrent.futures.Future:
        """A utility call on every replica: one answer (``get_stats`` summed)."""
        if method == "reset" and self.router is not None:
            self.router.reset()
        return _gather(self._call_each(method), _combine_outputs)

    def _call_each(self, method: str) -> list[concurrent.futures.Future]:
        return [client._call(method) for client in self.clients]


class DataParallelClient(SyncCalls, DataParallelClientBase):
    """The blocking calls of ``EngineCoreClient`` over the replicas (the offline ``LLM``)."""


class AsyncDataParallelClient(AsyncCalls, DataParallelClientBase):
    """The coroutine calls of ``AsyncEngineCoreClient`` over the replicas (the server)."""


def make_engine_core_client(
    engine_args: EngineArgs, asynchronous: bool, process: EngineProcess | None = None
) -> EngineCoreClientBase | DataParallelClientBase:
    """The front end's engine core client for ``engine_args``, its processes started (not yet
    sent their config): one engine core, or ``data_parallel_size`` replicas. ``process``: an
    engine core process started earlier (the launcher's), which becomes replica 0 (a Ray
    fleet stops it).

    Raises:
        ValueError: a data-parallel size or backend that is not valid.
    """
    args = engine_args
    parallel = ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        data_parallel_backend=args.data_parallel_backend,
    )
    size, backend = parallel.data_parallel_size, parallel.data_parallel_backend
    if size == 1 and backend == "mp":
        return (AsyncEngineCoreClient if asynchronous else EngineCoreClient)(process=process)
    if backend == "ray":
        if process is not None:
            process.stop()
        from mm_serve.frontend.ray_engine import start_ray_engine_cores  # Ray only when used

        processes = start_ray_engine_cores(parallel, args.device)
    else:
        processes = [process or start_engine_core()]
        processes += [start_engine_core() for _ in range(size - 1)]
    clients: list[EngineCoreClientBase] = []
    try:
        for replica in processes:
            clients.append(EngineCoreClientBase(process=replica))
    except BaseException:
        for client in clients:
            client.shutdown()
        for replica in processes[len(clients) :]:
            replica.stop()
        raise
    return (AsyncDataParallelClient if asynchronous else DataParallelClient)(clients)
