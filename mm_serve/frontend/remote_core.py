"""The offline ``LLM``'s engine core in its own process, behind ``EngineCore``'s interface.

As in vLLM V1's offline engine, the caller's process keeps the front end (tokenizing, hashing
and queueing images, detokenizing, stop strings) while the engine core process schedules,
launches and reads back steps: neither waits on the other's host work, so the device is not
left idle while the front end works. ``step()`` returns the outputs that arrived since the
last call rather than running a step.
"""

from __future__ import annotations

import queue

from mm_serve.config import EngineConfig
from mm_serve.frontend.core_client import EngineCoreClient
from mm_serve.frontend.dp_client import DataParallelClient
from mm_serve.frontend.exceptions import EngineRequestError
from mm_serve.messages.outputs import EngineCoreOutput
from mm_serve.messages.request import Request
from mm_serve.messages.stats import EngineStats

# How long ``step()`` waits for an output before it returns none (the caller then adds the
# prompts whose images became ready meanwhile, and calls again).
POLL_S = 0.005


class RemoteEngineCore:
    """``add_requests`` / ``abort_requests`` / ``step`` / ``has_unfinished_requests`` /
    ``get_stats`` / ``reset`` of ``EngineCore``, on an engine core process.

    ``client``: an ``EngineCoreClient`` (or a ``DataParallelClient`` of several replicas)
    started before the config was resolved (None: start one now); the constructor sends it
    ``config`` and waits until it is ready.

    Raises:
        EngineStartupError: from the constructor, when the process fails to start.
        EngineDeadError: from any call once the process is gone.
    """

    def __init__(
        self, config: EngineConfig, client: EngineCoreClient | DataParallelClient | None = None
    ) -> None:
        self.client = client or EngineCoreClient()
        self.client.start(config)
        self._outputs: queue.Queue = queue.Queue()  # every request's outputs, in arrival order
        self._unfinished: set[str] = set()

    def add_requests(self, requests: list[Request]) -> None:
        """The ``n`` siblings of one user request, in one message (see ``EngineCore``)."""
        self.client.add_requests(requests, self._outputs)
        self._unfinished.update(request.request_id for request in requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests; outputs of theirs already received still come from ``step()``."""
        self.client.abort_requests(request_ids)
        self._unfinished.difference_update(request_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def step(self) -> list[EngineCoreOutput]:
        """The outputs received since the last call, after waiting up to ``POLL_S`` for one.

        Raises:
            ValueError: the engine core refused a request (its message).
            RuntimeError: the engine core failed on a request.
            EngineDeadError: the engine core process is gone.
        """
        try:
            items = [self._outputs.get(timeout=POLL_S)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._outputs.get_nowait())
            except queue.Empty:
                break
        outputs = []
        for item in items:
            if isinstance(item, EngineRequestError):
                self._unfinished.discard(item.request_id)
                if item.kind == "internal":
                    raise RuntimeError(f"Request {item.request_id}: {item}") from item
                raise ValueError(str(item)) from item
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self._unfinished.discard(item.request_id)
            outputs.append(item)
        return outputs

    def get_stats(self) -> EngineStats:
        return self.client.get_stats()

    def reset(self) -> None:
        """``EngineCore.reset`` in the engine core process. Raises RuntimeError while requests
        are unfinished."""
        self.client.reset()

    def start_profile(self) -> None:
        """``EngineCore.start_profile`` in the engine core process (RuntimeError as it)."""
        self.client.start_profile()

    def stop_profile(self) -> None:
        """``EngineCore.stop_profile`` in the engine core process (RuntimeError as it)."""
        self.client.stop_profile()

    def shutdown(self) -> None:
        """Stop the engine core process. Idempotent."""
        self.client.shutdown()
