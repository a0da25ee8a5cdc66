"""Data-parallel engine cores as Ray actors (``--data-parallel-backend ray``).

``start_ray_engine_cores`` places one ``EngineCoreActor`` per replica in one placement group
(``ray_actors.Placement``: a CPU each, and on CUDA with local TP workers its
``tensor_parallel_size`` GPUs; packed on as few nodes as fit), from the API server, which
becomes the Ray driver. Each actor imports the engine at once (while the front end resolves
the config), then runs the engine core process's work (``EngineCoreProc.serve``) in one long
call on ``tcp://`` sockets that the front end's client bound on this node's address: the same
ZeroMQ wire as a local engine core. ``RayEngineProcess`` is what ``EngineProcess`` is to the
client (its ``proc`` an ``ActorProcess``, whose sentinel turns readable when Ray reports the
actor dead). The actors die with the front end, which owns them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from mm_serve.config import resolve_device
from mm_serve.config.parallel import ParallelConfig
from mm_serve.distributed.ray_actors import (
    ActorProcess,
    Placement,
    PlacementError,
    connect,
    node_ip,
)
from mm_serve.frontend.exceptions import EngineStartupError

logger = logging.getLogger(__name__)


class EngineCoreActor:
    """One engine core replica in a Ray actor (made remote by ``start_ray_engine_cores``)."""

    def __init__(self) -> None:
        import mm_serve.engine.core_proc  # noqa: F401  (seconds: while the config resolves)

    def where(self) -> tuple[int, str]:
        """(pid, node address) of the actor."""
        return os.getpid(), node_ip()

    def run(self, input_address: str, output_address: str, log_setup: Any, config: Any) -> int:
        """The engine core on the front end's sockets until the front end is gone (Ray then
        kills the actor); returns the exit code (1: the engine failed, ``EngineFailed`` sent)."""
        from mm_serve.engine.core_proc import EngineCoreProc, apply_log_setup

        apply_log_setup(log_setup)
        return EngineCoreProc(input_address, output_address, parent_pid=None).serve(config)


@dataclass
class RayEngineProcess:
    """An engine core actor waiting for its config, as the client sees an ``EngineProcess``:
    the client binds ``bind_addresses`` (tcp on this node, any port) and ``send_config``
    starts the actor's long call on the bound ``endpoints``."""

    proc: ActorProcess
    host: str
    placement: Placement
    ipc_paths: tuple[str, ...] = ()
    stopped: bool = False

    @property
    def bind_addresses(self) -> tuple[str, str]:
        return f"tcp://{self.host}:*", f"tcp://{self.host}:*"

    def send_config(self, setup: Any, config: Any, endpoints: tuple[str, str]) -> None:
        self.proc.watch(self.proc.actor.run.remote(*endpoints, setup, config))

    def stop(self, timeout_s: float = 5.0) -> None:
        """Kill the actor (``ray.kill``), wait for Ray to report it gone, and free the
        placement group once every replica is stopped. Safe to repeat."""
        if self.stopped:
            return
        self.stopped = True
        self.proc.kill()
        self.proc.join(timeout_s)
        self.placement.release()


def start_ray_engine_cores(parallel: ParallelConfig, device: str) -> list[RayEngineProcess]:
    """Place and start ``parallel.data_parallel_size`` engine core actors on the Ray cluster
    (``ray_actors.connect``). ``device``: ``EngineArgs.device`` (CUDA replicas get GPUs).

    Raises:
        EngineStartupError: the cluster has no room for them.
    """
    ray = connect()
    cuda = resolve_device(device).type == "cuda"
    bundle: dict[str, float] = {"CPU": 1}
    if cuda and parallel.distributed_executor_backend == "mp":  # its TP workers are local
        bundle["GPU"] = parallel.tensor_parallel_size
    size = parallel.data_parallel_size
    try:
        placement = Placement([dict(bundle) for _ in range(size)], users=size)
    except PlacementError as e:
        raise EngineStartupError(f"Cannot place the data-parallel engine cores: {e}") from e
    remote = ray.remote(EngineCoreActor)
    actors = [remote.options(**placement.actor_options(rank)).remote() for rank in range(size)]
    try:
        places = ray.get([actor.where.remote() for actor in actors])
    except Exception as e:  # an actor could not start: removing the group ends the others
        placement.remove()
        raise EngineStartupError(f"A data-parallel engine core actor failed: {e}") from e
    processes = []
    for rank, (actor, (pid, ip)) in enumerate(zip(actors, places, strict=True)):
        logger.info("Data-parallel engine core %d: Ray actor on %s (pid %d)", rank, ip, pid)
        proc = ActorProcess(actor, pid, f"mm_serve-engine-core-{rank}")
        processes.append(RayEngineProcess(proc, node_ip(), placement))
    return processes
