"""Tensor-parallel workers as Ray actors (``--distributed-executor-backend ray``).

``RayExecutor`` is ``MultiprocExecutor`` with its workers placed by Ray: one placement group
of ``tensor_parallel_size`` bundles (a GPU each on CUDA, else a CPU; packed on as few nodes as
fit, one node when it has the GPUs), one ``WorkerActor`` per bundle. Each actor runs the
worker's loop (``worker.worker_main``) in one long call, connected to the engine core's
``tcp://`` sockets on this node's address; the ranks join their ``torch.distributed`` group at
rank 0's node. The step messages and the failure handling are the executor's: an actor that
Ray reports dead (its process or its node gone) makes the next read raise ``WorkerDiedError``.
The actors die with the engine core process, which owns them (the Ray driver, or the
data-parallel replica's own actor).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from mm_serve.config import EngineConfig
from mm_serve.distributed import ray_actors
from mm_serve.distributed.mp_context import free_port
from mm_serve.engine.executor import MultiprocExecutor, WorkerDiedError, _Workers

logger = logging.getLogger(__name__)


class WorkerActor:
    """One tensor-parallel rank in a Ray actor (made remote by ``RayExecutor``)."""

    def __init__(self) -> None:
        import mm_serve.worker.worker  # noqa: F401  (the model code, before the call)

    def where(self) -> tuple[int, str, int]:
        """(pid, node address, a free port there): rank 0's is the group's rendezvous."""
        return os.getpid(), ray_actors.node_ip(), free_port("")

    def run(self, config: EngineConfig, rank: int, init_method: str, *addresses: str) -> int:
        """The worker's loop (``worker_main``) until the engine core shuts it down."""
        from mm_serve.worker.worker import worker_main

        # Ray shows an actor only its own GPUs: this rank's is cuda:0.
        return worker_main(config, rank, init_method, *addresses, None, device_index=0)


class RayExecutor(MultiprocExecutor):
    """``MultiprocExecutor`` whose workers are Ray actors (see the module doc).

    Raises (from the constructor and every call):
        WorkerDiedError: a worker failed or its actor died, or the cluster has no room for
            the workers.
    """

    def _bind(self) -> _Workers:
        ray_actors.connect()
        return _Workers(self.size, host=ray_actors.node_ip())

    def _start_workers(self, config: EngineConfig) -> None:
        ray = ray_actors.connect()
        bundle = {"GPU": 1} if config.device.type == "cuda" else {"CPU": 1}
        try:
            placement = ray_actors.Placement([dict(bundle) for _ in range(self.size)])
        except ray_actors.PlacementError as e:
            raise WorkerDiedError(f"Cannot place the tensor-parallel workers: {e}") from e
        self._workers.cleanups.append(placement.remove)
        remote = ray.remote(WorkerActor)
        actors = [remote.options(**placement.actor_options(r)).remote() for r in range(self.size)]
        places: list[Any] = ray.get([actor.where.remote() for actor in actors])
        _, host, port = places[0]
        init_method = f"tcp://{host}:{port}"
        workers = self._workers
        for rank, (actor, (pid, ip, _)) in enumerate(zip(actors, places, strict=True)):
            logger.info("Tensor-parallel worker %d: Ray actor on %s (pid %d)", rank, ip, pid)
            process = ray_actors.ActorProcess(actor, pid, f"mm_serve-tp-worker-{rank}")
            address = workers.input_addresses[rank]
            process.watch(
                actor.run.remote(config, rank, init_method, address, workers.output_address)
            )
            workers.processes.append(process)
