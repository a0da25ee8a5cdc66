"""The multiprocess executor: the engine core's side of tensor parallelism.

The engine core keeps the scheduler; this executor starts one worker process per rank
(``worker.worker.run_worker``, spawn) and stands in for the ``ModelRunner`` (same methods).
Each step it sends every rank the same ``SchedulerOutput`` (one ZeroMQ PUSH socket per rank,
msgspec frames, ``worker.worker_messages``); rank 0 alone answers with the step's
``ModelRunnerOutput``, once the next step is launched or the core asks for it ("flush"). A
worker that dies or fails makes the next read raise ``WorkerDiedError`` at once (the other
ranks are stopped: they may wait in a collective). ``RayExecutor`` (``engine/ray_executor.py``)
is the same over Ray actors on tcp:// sockets.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from mm_serve.config import EngineConfig
from mm_serve.distributed.mp_context import free_port, no_main_context
from mm_serve.sched.output import ModelRunnerOutput, SchedulerOutput
from mm_serve.sched.structured_output import GrammarBitmask
from mm_serve.worker.worker import run_worker
from mm_serve.worker.worker_messages import (
    StepResult,
    WorkerCall,
    WorkerFailed,
    WorkerResult,
    decode_from_worker,
    encode_step,
)

logger = logging.getLogger(__name__)

POLL_INTERVAL_MS = 100  # how often a waiting read checks that every worker is alive
SHUTDOWN_TIMEOUT_S = 5.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker exited or failed; the engine cannot go on."""


class StepFuture:
    """Rank 0's output of one step, read from the socket on the first ``get()`` (the steps'
    outputs arrive in order, so reading one reads those before it first)."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        self._executor = executor
        self.output: ModelRunnerOutput | None = None

    @property
    def done(self) -> bool:
        return self.output is not None

    def get(self) -> ModelRunnerOutput:
        """Raises ``WorkerDiedError`` if a worker dies before the output comes."""
        if self.output is None:
            self._executor._flush(self)
        while self.output is None:
            self._executor._receive()
        return self.output


class _Workers:
    """The processes, sockets and ipc folder; ``stop()`` is also the executor's finalizer.

    The sockets are bound on ``ipc://`` files in a fresh folder, or with ``host`` on
    ``tcp://host`` ports (workers on other nodes); ``input_addresses`` (one per rank) and
    ``output_address`` are the bound endpoints. ``cleanups`` run last in ``stop()``.
    """

    def __init__(self, size: int, host: str | None = None) -> None:
        self.folder = tempfile.mkdtemp(prefix="mm_serve-tp-")
        self.ctx = zmq.Context()
        self.inputs = []
        for rank in range(size):
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.bind(f"tcp://{host}:*" if host else f"ipc://{self.folder}/in{rank}")
            self.inputs.append(push)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.bind(f"tcp://{host}:*" if host else f"ipc://{self.folder}/out")
        endpoint = zmq.LAST_ENDPOINT
        self.input_addresses = [push.getsockopt(endpoint).decode() for push in self.inputs]
        self.output_address = self.output.getsockopt(endpoint).decode()
        self.processes: list[Any] = []
        self.cleanups: list[Callable[[], None]] = []

    def stop(self) -> None:
        """Ask each live worker to exit, then terminate and kill the ones left; close all."""
        shutdown = msgspec.msgpack.encode(WorkerCall("shutdown"))
        for push, process in zip(self.inputs, self.processes, strict=False):
            if process.is_alive():
                push.send(shutdown, zmq.NOBLOCK)
        for process in self.processes:
            process.join(SHUTDOWN_TIMEOUT_S / max(1, len(self.processes)))
            if process.is_alive():
                process.terminate()
                process.join(1.0)
            if process.is_alive():
                process.kill()
                process.join()
        for sock in [*self.inputs, self.output]:
            sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.folder, ignore_errors=True)
        for cleanup in self.cleanups:
            cleanup()


class MultiprocExecutor:
    """``config.parallel.tensor_parallel_size`` worker processes, one per rank, each with
    its shard of the model; the constructor returns once every rank has loaded its shard.

    Raises (from the constructor and every call):
        WorkerDiedError: a worker failed (its traceback in the message) or exited.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.size = config.parallel.tensor_parallel_size
        self._workers = self._bind()
        self._finalizer = weakref.finalize(self, self._workers.stop)
        self._pending: collections.deque[StepFuture] = collections.deque()
        self._flushed = False  # whether the last step sent was flushed (``_flush``)
        self._failed: str | None = None
        try:
            self._start_workers(config)
        except BaseException:
            self._finalizer()
            raise
        self._collect_results()  # every rank loaded its shard
        logger.info("Started %d tensor-parallel workers", self.size)

    def _bind(self) -> _Workers:
        return _Workers(self.size)

    def _start_workers(self, config: EngineConfig) -> None:
        """One spawned process per rank, on the ipc sockets."""
        init_method = f"tcp://127.0.0.1:{free_port()}"
        context = no_main_context("spawn")
        workers = self._workers
        for rank in range(self.size):
            args = (config, rank, init_method, workers.input_addresses[rank])
            process = context.Process(
                target=run_worker,
                args=(*args, workers.output_address, os.getpid()),
                name=f"mm_serve-tp-worker-{rank}",
                daemon=True,
            )
            process.start()
            workers.processes.append(process)

    # ---- the ModelRunner's methods ---------------------------------------------------------

    def load_model(self) -> None:
        """Nothing: each worker loaded its shard while the constructor waited."""

    def determine_num_kv_blocks(self) -> int:
        """The fewest KV blocks any rank fits (each rank holds its KV heads of every block)."""
        return min(self._call("determine_num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call("initialize_kv_cache", num_blocks)

    def capture_cuda_graphs(self) -> None:
        self._call("capture_cuda_graphs")

    def reset_encoder_cache(self) -> None:
        self._call("reset_encoder_cache")

    def start_profile(self) -> None:
        """Start each worker's torch profiler (``EngineCore.start_profile`` checked first)."""
        self._call("start_profile")

    def stop_profile(self) -> None:
        """Stop each worker's torch profiler; each writes its trace."""
        self._call("stop_profile")

    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        grammar_bitmask: Callable[[], GrammarBitmask] | None = None,
    ) -> StepFuture:
        """Send the step to every rank; the bitmask (which reads the previous step's tokens)
        is computed first and travels with it. Returns rank 0's output to come."""
        bitmask = None if grammar_bitmask is None else grammar_bitmask()
        self._broadcast(encode_step(scheduler_output, bitmask))
        self._flushed = False
        future = StepFuture(self)
        self._pending.append(future)
        return future

    def shutdown(self) -> None:
        """Stop the workers (also when the executor is collected)."""
        self._finalizer()

    def _flush(self, future: StepFuture) -> None:
        """Ask for the output of the last step sent, which a worker holds back until its next
        message (``worker.serve``); an earlier step's output comes once a later step is sent."""
        if self._pending and self._pending[-1] is future and not self._flushed:
            self._broadcast([msgspec.msgpack.encode(WorkerCall("flush"))])
            self._flushed = True

    # ---- messages ----------------------------------------------------------------------------

    def _broadcast(self, frames: list[Any]) -> None:
        self._check_alive()
        for push in self._workers.inputs:
            push.send_multipart(frames, copy=False)

    def _call(self, method: str, arg: int = 0) -> list[int | None]:
        """Run ``method`` on every rank; their results in rank order."""
        self._broadcast([msgspec.msgpack.encode(WorkerCall(method, arg))])
        return self._collect_results()

    def _collect_results(self) -> list[int | None]:
        results: dict[int, int | None] = {}
        while len(results) < self.size:
            result = self._receive()
            if result is not None:
                results[result.rank] = result.value
        return [results[rank] for rank in range(self.size)]

    def _receive(self) -> WorkerResult | None:
        """Read one message: a step's output goes to the oldest pending ``StepFuture`` (None
        returned); a ``WorkerResult`` is returned. Raises ``WorkerDiedError`` (and stops the
        workers) on ``WorkerFailed`` or a worker that is gone."""
        output = self._workers.output
        while not output.poll(POLL_INTERVAL_MS, zmq.POLLIN):
            self._check_alive()
        message = decode_from_worker(output.recv())
        if isinstance(message, WorkerFailed):
            self._fail(f"Tensor-parallel worker {message.rank} failed:\n{message.error}")
        if isinstance(message, StepResult):
            self._pending.popleft().output = message.output
            return None
        return message

    def _check_alive(self) -> None:
        if self._failed is not None:
            raise WorkerDiedError(self._failed)
        for rank, process in enumerate(self._workers.processes):
            if not process.is_alive():
                self._fail(
                    f"Tensor-parallel worker {rank} (pid {process.pid}) exited with code "
                    f"{process.exitcode}."
                )

    def _fail(self, reason: str) -> None:
        self._failed = reason
        logger.error("%s The engine stops.", reason)
        self._finalizer()  # the other ranks may wait in a collective for ever
        raise WorkerDiedError(reason)
