"""The engine core in its own process: a busy loop fed and drained over ZeroMQ.

Three threads:

- input thread: receives multipart messages from every client (API-server process),
  decodes them (``messages.InputCodec``; image tensors stay in their ZeroMQ frames) and puts
  them on ``input_queue`` with the client's index; it also watches the parent and ends the
  process when the parent is gone, so no orphan is left.
- main thread (``run_busy_loop``): drains ``input_queue`` (add / abort / utility), runs
  ``EngineCore.step()`` while requests remain, and waits on the queue when idle
  (waking every ``IDLE_WAKEUP_S`` so that a signal is handled).
- output thread: encodes ``EngineCoreOutputs`` and sends them to their client (the one that
  sent the request or call, ``OutputRouter``), overlapping the next step.

Each front-end client binds its two ipc sockets and owns their files; this process connects.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch
import zmq

from mm_serve.config import EngineConfig
from mm_serve.distributed.mp_context import PARENT_CHECK_INTERVAL_MS
from mm_serve.engine.core import EngineCore
from mm_serve.engine.output_router import OutputRouter
from mm_serve.messages.request import Request, check_image_tokens
from mm_serve.messages.wire import (
    AbortRequests,
    EngineCoreOutputs,
    EngineFailed,
    EngineReady,
    InputCodec,
    KVCacheInfo,
    OutputCodec,
    RequestDecodeError,
    RequestError,
    UtilityRequest,
)
from mm_serve.utils import quiet_exit
from mm_serve.worker.worker import limit_cpu_threads

logger = logging.getLogger(__name__)

_SHUTDOWN = object()  # input/output queue marker: stop the loop / the output thread
# How long the idle main thread waits on the input queue before it looks again. Python runs a
# signal's handler in the main thread only, and a wait without a timeout is not woken when the
# kernel delivers the signal to another thread (on CUDA the driver's threads are many): the
# front end's SIGTERM would then go unanswered until its SIGKILL.
IDLE_WAKEUP_S = 0.1


def run_engine_core(
    config_reader: Connection,
    input_address: str | Sequence[str],
    output_address: str | Sequence[str],
    parent_pid: int,
) -> None:
    """Entry point of the engine core process (started with the "spawn" method).

    Connects to the front end's sockets, waits for the front end's logging set-up and
    ``EngineConfig`` on ``config_reader`` (``receive_config``), builds the engine and answers
    ``EngineReady`` (or ``EngineFailed`` with the traceback, then exits with code 1), then
    serves until the parent dies. A fatal error in the loop is reported as ``EngineFailed``
    before exiting 1. The config is the front end's, resolved once there: this process reads
    no ``config.json`` and builds no image processor for it. Exits with code 0 if the front
    end is gone, or closed the pipe, before sending the config.
    """
    imported = time.monotonic()
    quiet_exit.install()
    # Ctrl-C in a terminal reaches the whole process group; the front end decides to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM (the front end's shutdown) unwinds the main thread, so that exit handlers run.
    signal.signal(signal.SIGTERM, _raise_system_exit)
    proc = EngineCoreProc(input_address, output_address, parent_pid)
    received = receive_config(config_reader, parent_pid)
    if received is None:
        sys.exit(0)
    log_setup, config = received
    apply_log_setup(log_setup)
    logger.info(
        "The engine core process (pid %d) got its config %.1f s after importing the engine",
        os.getpid(),
        time.monotonic() - imported,
    )
    exit_code = proc.serve(config)
    if exit_code == 0:
        quiet_exit.mark_clean()
    sys.exit(exit_code)


def apply_log_setup(log_setup: tuple[str, int, int] | None) -> None:
    """Log as the front end does (``frontend.engine_process.log_setup``: format, root level,
    ``mm_serve`` level; None: leave logging alone)."""
    if log_setup is not None:
        fmt, root_level, level = log_setup
        logging.basicConfig(level=root_level, format=fmt)
        logging.getLogger("mm_serve").setLevel(level)


def receive_config(reader: Connection, parent_pid: int) -> tuple[Any, EngineConfig] | None:
    """The front end's (logging set-up, config), or None once the front end is gone or closed
    the pipe.

    First imports what unpickling a transformers 5 config imports (its ``auto_docstring``
    loads ``modeling_auto`` and with it much of transformers and torch: seconds), while the
    front end is still resolving the config.
    """
    import transformers.models.auto.modeling_auto  # noqa: F401

    while not reader.poll(PARENT_CHECK_INTERVAL_MS / 1000):
        if os.getppid() != parent_pid:
            return None
    try:
        return reader.recv()
    except EOFError:  # the front end failed before it had a config
        return None


def _raise_system_exit(signum: int, frame: Any) -> None:
    # Once: a second SIGTERM (the server's process group and the client both send one) must
    # not interrupt the exit handlers the first one started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    quiet_exit.mark_clean()  # the front end's way to stop this process
    raise SystemExit(128 + signum)


class EngineCoreProc:
    """Owns the sockets, the queues and the ``EngineCore`` of the engine core process.

    Args:
        input_address / output_address: the front end's ``ipc://`` endpoints (``tcp://`` for
            a Ray actor), or one of each per client (API-server process), in client order.
        parent_pid: the front end's pid; when ``os.getppid()`` changes, it is gone. None in a
            Ray actor, which Ray ends when the front end that owns it is gone.
    """

    def __init__(
        self,
        input_address: str | Sequence[str],
        output_address: str | Sequence[str],
        parent_pid: int | None,
    ) -> None:
        self.parent_pid = parent_pid
        inputs, outputs = _as_list(input_address), _as_list(output_address)
        if len(inputs) != len(outputs):
            raise ValueError("Each client needs one input and one output address.")
        self.ipc_paths = [a.removeprefix("ipc://") for a in (*inputs, *outputs)]
        self.ctx = zmq.Context()
        self.input_sockets = [self._connect(zmq.PULL, address) for address in inputs]
        self.output_sockets = [self._connect(zmq.PUSH, address) for address in outputs]
        self.router = OutputRouter(len(outputs))
        self.input_queue: queue.Queue[Any] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self.stopping = threading.Event()  # tells the input thread to return
        self.engine_core: EngineCore | None = None

    def _connect(self, socket_type: int, address: str) -> zmq.Socket:
        socket = self.ctx.socket(socket_type)
        # Never block the loop on a slow reader, nor drop an input.
        socket.setsockopt(zmq.SNDHWM if socket_type == zmq.PUSH else zmq.RCVHWM, 0)
        socket.connect(address)
        return socket

    def serve(self, config: EngineConfig) -> int:
        """Start up (answering ``EngineReady`` or ``EngineFailed``), then run the busy loop
        until the parent is gone or SIGTERM. Returns the process exit code."""
        # Both threads first: the parent is watched during the (long) model load too.
        threads = [
            threading.Thread(target=self._input_loop, name="engine-core-input", daemon=True),
            threading.Thread(target=self._output_loop, name="engine-core-output", daemon=True),
        ]
        for thread in threads:
            thread.start()
        exit_code = 0
        try:
            self._start_engine(config)
            self.run_busy_loop()
        except Exception as e:
            during_startup = self.engine_core is None
            logger.exception(
                "The engine core %s", "failed to start" if during_startup else "failed"
            )
            message = f"{type(e).__name__}: {e}"
            failed = EngineFailed(message, traceback.format_exc(), during_startup)
            self.output_queue.put((None, failed))
            exit_code = 1
        finally:  # also on SystemExit (SIGTERM)
            stopping = time.monotonic()
            self.stopping.set()
            self.output_queue.put(_SHUTDOWN)
            for thread in threads:
                thread.join(timeout=5)
            for socket in self.output_sockets:
                socket.close(linger=2000)  # let the last outputs reach the front end
            self.ctx.term()
            logger.info(
                "The engine core stopped its threads and sockets in %.2f s",
                time.monotonic() - stopping,
            )
        return exit_code

    def _start_engine(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        if config.device.type == "cuda":
            limit_cpu_threads()
        elif config.parallel.processes_per_host > 1 and "OMP_NUM_THREADS" not in os.environ:
            # Local data-parallel replicas (or TP ranks) share the cores.
            cores = os.cpu_count() or 1
            torch.set_num_threads(max(1, cores // config.parallel.processes_per_host))
        self.engine_core = EngineCore(config)
        kv = self.engine_core.scheduler.kv_cache_manager
        ready = EngineReady(
            pid=os.getpid(),
            model=config.model.model,
            max_model_len=config.model.max_model_len,
            vocab_size=config.model.vocab_size,
            num_kv_blocks=kv.num_blocks,
            block_size=config.cache.block_size,
        )
        logger.info("The engine core started in %.1f s", time.perf_counter() - start)
        self.output_queue.put((None, ready))  # to every client

    def run_busy_loop(self) -> None:
        """Drain the inputs, step while there is work, wait on the input queue when idle.

        Returns when the input thread reports the parent gone; raises whatever ``step()``
        raises (a bug, fatal to the engine).
        """
        engine_core = self.engine_core
        while True:
            if not self._process_input_queue(block=not engine_core.has_unfinished_requests()):
                return
            if engine_core.has_unfinished_requests():
                outputs = engine_core.step()
                if outputs:
                    message = EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic())
                    for part in self.router.split(message):
                        self.output_queue.put(part)

    def _process_input_queue(self, block: bool) -> bool:
        """Handle every queued input (waiting up to ``IDLE_WAKEUP_S`` for one if ``block``);
        False on shutdown."""
        try:
            item = self.input_queue.get(block=block, timeout=IDLE_WAKEUP_S if block else None)
            while True:
                if item is _SHUTDOWN:
                    return False
                self._handle_input(*item)
                item = self.input_queue.get_nowait()
        except queue.Empty:
            return True

    def _handle_input(self, client: int, item: Any) -> None:
        """Handle one decoded input of ``client``; answers and errors go back to it."""
        if isinstance(item, list):  # an add-request's engine requests, or their errors
            adds = [r for r in item if isinstance(r, Request)]
            errors = [e for e in item if isinstance(e, RequestError)]
            for request in adds:
                error = self._add_request(request)
                if error is None:
                    self.router.add(request.request_id, client)
                else:
                    errors.append(error)
            if errors:
                self.output_queue.put((client, EngineCoreOutputs(errors=errors)))
        elif isinstance(item, AbortRequests):
            self.engine_core.abort_requests(item.request_ids)
            self.router.remove(item.request_ids)
        elif isinstance(item, UtilityRequest):
            self.output_queue.put((client, self._call_utility(item)))
        elif isinstance(item, BaseException):
            raise RuntimeError("The engine core's input thread failed.") from item

    def _add_request(self, request: Request) -> RequestError | None:
        """Add a request; a rejected one becomes its error, never an exception of the loop."""
        try:
            self._check_request(request)
            self.engine_core.add_request(request)
        except ValueError as e:
            return RequestError(request.request_id, str(e))
        except Exception as e:
            logger.exception("Adding request %s failed", request.request_id)
            return RequestError(request.request_id, f"{type(e).__name__}: {e}", "internal")
        return None

    def _check_request(self, request: Request) -> None:
        """What the model would crash on rather than reject (the front end checks it too).

        Raises:
            ValueError: token ids (prompt or stop) outside the vocabulary, image tokens that no
                image fills, or an image without pixels or whose placeholder range is outside
                the prompt or disagrees with its size (or with its own ``token_ids``).
        """
        token_ids, model = request.prompt_token_ids, self.engine_core.config.model
        vocab_size = model.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab_size:
            raise ValueError(f"Prompt token ids must be in [0, {vocab_size}).")
        if any(not 0 <= t < vocab_size for t in request.sampling_params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size}).")
        check_image_tokens(
            token_ids, request.mm_features, model.image_token_id, model.video_token_id
        )
        for feature in request.mm_features:
            placeholder, data = feature.placeholder, feature.data
            if placeholder.offset < 0 or placeholder.end > len(token_ids):
                raise ValueError(f"Image {feature.mm_hash!r}: placeholder outside the prompt.")
            if data is None or data.num_tokens != placeholder.length:
                raise ValueError(
                    f"Image {feature.mm_hash!r}: no pixels, or a token count that differs from "
                    "its placeholder's length."
                )
            own = data.token_ids
            if own is not None and token_ids[placeholder.offset : placeholder.end] != list(own):
                raise ValueError(f"Image {feature.mm_hash!r}: the prompt differs from its tokens.")

    def _call_utility(self, call: UtilityRequest) -> EngineCoreOutputs:
        """``get_stats`` (the counters and the KV pool), or ``reset``, ``start_profile`` or
        ``stop_profile`` of ``EngineCore`` (whose errors the answer carries)."""
        engine_core = self.engine_core
        if call.method in ("reset", "start_profile", "stop_profile"):
            try:
                getattr(engine_core, call.method)()
            except (RuntimeError, ValueError) as e:
                return EngineCoreOutputs(call_id=call.call_id, call_error=str(e))
            if call.method == "reset":
                # After the start-up warm-up: what start-up made (model, caches, kernels) lives
                # as long as this process, so later collections need not walk it (as vLLM does).
                gc.collect()
                gc.freeze()
            return EngineCoreOutputs(call_id=call.call_id)
        if call.method != "get_stats":
            return EngineCoreOutputs(
                call_id=call.call_id, call_error=f"Unknown utility method {call.method!r}."
            )
        stats = engine_core.get_stats()
        kv = engine_core.scheduler.kv_cache_manager
        kv_info = KVCacheInfo(kv.num_blocks, kv.num_free_blocks, kv.block_size)
        return EngineCoreOutputs(stats=stats, kv_cache=kv_info, call_id=call.call_id)

    # ---- threads -----------------------------------------------------------------------

    def _input_loop(self) -> None:
        codec = InputCodec()
        poller = zmq.Poller()
        for socket in self.input_sockets:
            poller.register(socket, zmq.POLLIN)
        client_of = {socket: client for client, socket in enumerate(self.input_sockets)}
        try:
            while not self.stopping.is_set():
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    self._exit_orphaned()
                for socket, _ in poller.poll(PARENT_CHECK_INTERVAL_MS):
                    item = self._decode(codec, socket.recv_multipart(copy=False))
                    if item is not None:
                        self.input_queue.put((client_of[socket], item))
        except Exception as e:
            logger.exception("The engine core's input thread failed")
            self.input_queue.put((0, e))
        finally:
            for socket in self.input_sockets:  # by their owner thread: not thread-safe
                socket.close(linger=0)

    @staticmethod
    def _decode(codec: InputCodec, frames: list[Any]) -> Any:
        """One message's input; the errors of its requests if it cannot be decoded, or None
        (logged) when it names no request."""
        try:
            return codec.decode(frames)
        except RequestDecodeError as e:
            if not e.request_ids:
                logger.error("Dropped a message that could not be decoded: %s", e)
                return None
            return [RequestError(request_id, str(e)) for request_id in e.request_ids]

    def _exit_orphaned(self) -> None:
        """The front end died without shutting us down: nobody reads our outputs; exit now."""
        logger.warning("The front end (pid %d) is gone; the engine core exits.", self.parent_pid)
        with contextlib.suppress(OSError):  # the front end could not remove them
            for path in self.ipc_paths:
                os.unlink(path)
            os.rmdir(os.path.dirname(self.ipc_paths[0]))
        os._exit(1)

    def _output_loop(self) -> None:
        codec = OutputCodec()
        while True:
            item = self.output_queue.get()
            if item is _SHUTDOWN:
                return
            client, message = item  # client None: every client
            body = codec.encode(message)
            sockets = self.output_sockets if client is None else [self.output_sockets[client]]
            for socket in sockets:
                socket.send(body, copy=False)


def _as_list(address: str | Sequence[str]) -> list[str]:
    return [address] if isinstance(address, str) else list(address)
