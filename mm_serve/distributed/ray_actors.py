"""Ray placement for the ray backends: the cluster connection, placement groups, and a Ray
actor that runs one long call, seen as a process.

Ray only places, starts and watches; the data still goes over ZeroMQ (tcp:// between nodes).
Used by the front end (data-parallel engine cores, ``frontend/ray_engine.py``) and by the
engine core (tensor-parallel workers, ``engine/ray_executor.py``). Imports Ray on first use.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0  # how long the cluster may take to find room for the bundles


class PlacementError(RuntimeError):
    """The Ray cluster has no room for the actors asked for."""


def connect() -> Any:
    """``ray.init()`` once per process: the cluster of ``RAY_ADDRESS``, else the one ``ray
    start`` started on this host, else a new local one (inside a Ray actor: its own). Returns
    the ``ray`` module."""
    import ray

    if not ray.is_initialized():
        handler = signal.getsignal(signal.SIGTERM)
        ray.init(logging_level=logging.WARNING)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, handler)  # the process's own, not Ray's sys.exit
    return ray


def node_ip() -> str:
    """This node's address, as the other nodes reach it."""
    import ray.util

    return ray.util.get_node_ip_address()


class Placement:
    """A Ray placement group of ``bundles`` (resources such as ``{"CPU": 1, "GPU": 2}``),
    packed on as few nodes as fit (``PACK``), ready when the constructor returns; removed
    when its ``users`` each called ``release()``.

    Raises:
        PlacementError: the cluster had no room within ``timeout_s``.
    """

    def __init__(
        self,
        bundles: list[dict[str, float]],
        users: int = 1,
        timeout_s: float = PLACEMENT_TIMEOUT_S,
    ) -> None:
        ray = connect()
        from ray.util.placement_group import placement_group

        self.bundles, self.users = bundles, users
        self._lock = threading.Lock()
        self.group = placement_group(bundles, strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=timeout_s)
        if not ready:
            self.remove()
            raise PlacementError(
                f"The Ray cluster has no room for {len(bundles)} x {bundles[0]} within "
                f"{timeout_s:.0f} s (its resources: {ray.cluster_resources()})."
            )
        self._removed = False

    def actor_options(self, index: int) -> dict[str, Any]:
        """``ActorClass.options(...)`` that place an actor in bundle ``index``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.bundles[index]
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)
        return {
            "num_cpus": bundle.get("CPU", 0),
            "num_gpus": bundle.get("GPU", 0),
            "scheduling_strategy": strategy,
        }

    def release(self) -> None:
        """One user is done with the group: the last one removes it."""
        with self._lock:
            self.users -= 1
            last = self.users == 0
        if last:
            self.remove()

    def remove(self) -> None:
        """Free the bundles (once)."""
        if not getattr(self, "_removed", False):
            from ray.util.placement_group import remove_placement_group

            self._removed = True
            remove_placement_group(self.group)


class ActorProcess:
    """A Ray actor running one long call, with what the engine core client and the executor
    use of ``multiprocessing.Process``: ``pid``, ``sentinel`` (a file descriptor that turns
    readable once the call returned or the actor died: Ray's failure detection, read by a
    thread blocked in ``ray.get``), ``is_alive()``, ``exitcode`` (the call's return value, 1
    if the actor died, ``-SIGKILL`` if we killed it), ``join``, ``terminate`` and ``kill``
    (``ray.kill``).
    """

    def __init__(self, actor: Any, pid: int, name: str) -> None:
        self.actor, self.pid, self.name = actor, pid, name
        self.exitcode: int | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._killed = False
        self.sentinel, self._write_end = os.pipe()

    def watch(self, call: Any) -> None:
        """Watch the actor's long call (its ``ObjectRef``) from a thread."""
        thread = threading.Thread(target=self._wait, args=(call,), daemon=True, name=self.name)
        thread.start()

    def _wait(self, call: Any) -> None:
        import ray

        try:
            result = ray.get(call)
            self._finish(result if isinstance(result, int) else 0)
        except Exception as e:  # the actor died: its node, its process, or ray.kill
            if not self._killed:
                logger.error("The Ray actor %s (pid %s) is gone: %s", self.name, self.pid, e)
            self._finish(1)

    def _finish(self, exitcode: int) -> None:
        """Record the end (once) and make the sentinel readable."""
        with self._lock:
            if self._done.is_set():
                return
            self.exitcode = exitcode
            self._done.set()
        os.close(self._write_end)

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def kill(self) -> None:
        """``ray.kill``: the actor's process ends at once (its own actors with it); it counts
        as ended from now on."""
        import ray

        self._killed = True
        if self.is_alive():
            ray.kill(self.actor, no_restart=True)
            self._finish(-signal.SIGKILL)

    terminate = kill
