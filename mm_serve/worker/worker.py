"""A tensor-parallel worker process: one rank's model shard, KV cache and request state.

Started by ``engine.executor.MultiprocExecutor`` (spawn), one per rank, or as a Ray actor by
``engine.ray_executor.RayExecutor``. It joins the
``torch.distributed`` group (gloo on CPU, NCCL on CUDA), sets its TP rank, builds its own
``ModelRunner`` and loads its shard of the weights. Then it replays every step the engine core
sends: all ranks run the same forward pass (the layers all-reduce and all-gather between
them) and sample the same tokens (the logits are gathered whole on every rank; the RNG is
seeded alike), so each rank's request state stays the same; only rank 0 returns the output.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
import sys
import traceback
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import zmq

from mm_serve.config import EngineConfig
from mm_serve.distributed.mp_context import PARENT_CHECK_INTERVAL_MS
from mm_serve.utils import quiet_exit
from mm_serve.utils.profiler import TorchProfiler
from mm_serve.worker.model_runner import ModelRunner
from mm_serve.worker.step_output import PendingOutput
from mm_serve.worker.worker_messages import (
    ExecuteModel,
    StepResult,
    WorkerCall,
    WorkerFailed,
    WorkerResult,
    decode_step,
    decode_to_worker,
)

logger = logging.getLogger(__name__)

CALLS = ("determine_num_kv_blocks", "initialize_kv_cache", "capture_cuda_graphs",
         "reset_encoder_cache", "start_profile", "stop_profile")  # fmt: skip


def limit_cpu_threads() -> None:
    """One intra-op CPU thread for torch in a CUDA engine core or worker process, unless
    ``OMP_NUM_THREADS`` says otherwise (as vLLM's GPU workers do).

    Its CPU work is small (gathering pixels, input tables); with a thread per core, each
    parallel region waits for threads that the preprocessing workers have descheduled, which
    slows the launch of every encode step while images are arriving.
    """
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def init_worker_distributed(
    config: EngineConfig, rank: int, init_method: str, device_index: int | None = None
) -> EngineConfig:
    """Join the TP group as ``rank`` and return the config with this rank's device: on CUDA
    ``cuda:device_index``, by default the replica's first device plus ``rank``; on CPU a share
    of the host's cores. Gloo on CPU, NCCL on CUDA."""
    size = config.parallel.tensor_parallel_size
    if config.device.type == "cuda":
        if device_index is None:
            device_index = (config.device.index or 0) + rank
        device = torch.device("cuda", device_index)
        torch.cuda.set_device(device)
        limit_cpu_threads()
        config = dataclasses.replace(config, device=device)
        backend = "nccl"
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.parallel.processes_per_host))
        backend = "gloo"
    dist.init_process_group(backend, init_method=init_method, world_size=size, rank=rank)
    return config


def run_worker(
    config: EngineConfig,
    rank: int,
    init_method: str,
    input_address: str,
    output_address: str,
    parent_pid: int,
) -> None:
    """Entry point of the worker process of ``rank`` (``worker_main``); exits with its code."""
    quiet_exit.install()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when to stop
    signal.signal(signal.SIGTERM, _raise_system_exit)
    exit_code = worker_main(config, rank, init_method, input_address, output_address, parent_pid)
    if exit_code == 0:
        quiet_exit.mark_clean()
    sys.exit(exit_code)


def worker_main(
    config: EngineConfig,
    rank: int,
    init_method: str,
    input_address: str,
    output_address: str,
    parent_pid: int | None,
    device_index: int | None = None,
) -> int:
    """Connect to the core's sockets, load the shard, answer ``WorkerResult`` (loaded), then
    serve until told to shut down (returns 0) or until the core is gone. A fatal error is
    sent as ``WorkerFailed`` (returns 1). ``parent_pid``: the core process (None in a Ray
    actor, which Ray ends with its owner); ``device_index``: see ``init_worker_distributed``."""
    ctx = zmq.Context()
    inputs, outputs = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inputs.connect(input_address)
    outputs.connect(output_address)
    try:
        config = init_worker_distributed(config, rank, init_method, device_index)
        runner = ModelRunner(config, rank=rank)
        runner.load_model()
        outputs.send(msgspec.msgpack.encode(WorkerResult(rank)))
        serve(runner, rank, inputs, outputs, parent_pid)
    except Exception:
        error = traceback.format_exc()
        logger.error("Tensor-parallel worker %d failed:\n%s", rank, error)
        outputs.send(msgspec.msgpack.encode(WorkerFailed(rank, error)))
        outputs.close(linger=2000)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    inputs.close(linger=0)
    outputs.close(linger=2000)
    return 0


def serve(
    runner: ModelRunner,
    rank: int,
    inputs: zmq.Socket,
    outputs: zmq.Socket,
    parent_pid: int | None,
) -> None:
    """Run the core's messages in order until ``WorkerCall("shutdown")``; exit at once if the
    core process is gone (nobody would read the outputs).

    A step's output is sent once the next message is in: a step the core sends before reading
    the last one's output is launched first, so the device runs one step while this process
    prepares the next (the core's async scheduling, across the two processes). "flush" (the
    core waits on the last step sent) and every call send it without launching anything.
    """
    in_flight: PendingOutput | None = None
    profiler = TorchProfiler(f"rank{rank}")
    while True:
        if not inputs.poll(PARENT_CHECK_INTERVAL_MS, zmq.POLLIN):
            if parent_pid is not None and os.getppid() != parent_pid:
                logger.warning("The engine core is gone; TP worker %d exits.", rank)
                os._exit(1)
            continue
        frames = inputs.recv_multipart(copy=False)
        message = decode_to_worker(frames[0])
        launched = execute(runner, message, frames) if isinstance(message, ExecuteModel) else None
        if in_flight is not None:
            output = in_flight.get()  # its tokens go into the request states on every rank
            if rank == 0:
                outputs.send(msgspec.msgpack.encode(StepResult(output)))
        in_flight = launched
        if isinstance(message, ExecuteModel) or message.method == "flush":
            continue
        if message.method == "shutdown":
            return
        outputs.send(msgspec.msgpack.encode(call(runner, rank, message, profiler)))


def execute(runner: ModelRunner, message: ExecuteModel, frames: list[Any]) -> PendingOutput:
    """Launch one step on this rank; its output is read (``PendingOutput.get``) later."""
    scheduler_output, bitmask = decode_step(message, frames)
    return runner.execute_model(scheduler_output, None if bitmask is None else lambda: bitmask)


def call(
    runner: ModelRunner, rank: int, message: WorkerCall, profiler: TorchProfiler
) -> WorkerResult:
    """Run one of ``CALLS`` (ValueError for another name) on the runner, or on this process's
    ``profiler`` ("start_profile", "stop_profile"); the answer carries its int result. The core
    checked the profiler's settings first; a worker whose own differ (a Ray node's
    environment) logs why it does not profile and goes on serving."""
    if message.method not in CALLS:
        raise ValueError(f"Unknown worker call {message.method!r}.")
    if message.method in ("start_profile", "stop_profile"):
        try:
            getattr(profiler, message.method.removesuffix("_profile"))()
        except (RuntimeError, ValueError) as e:
            logger.warning("Tensor-parallel worker %d: %s", rank, e)
        return WorkerResult(rank)
    method = getattr(runner, message.method)
    value = method(message.arg) if message.method == "initialize_kv_cache" else method()
    if message.method == "reset_encoder_cache":  # the engine's reset, after start-up's warm-up
        gc.collect()  # what start-up made lives as long as the process (as in the engine core)
        gc.freeze()
    return WorkerResult(rank, value if isinstance(value, int) else None)


def _raise_system_exit(signum: int, frame: Any) -> None:
    quiet_exit.mark_clean()  # the engine's way to stop this worker
    raise SystemExit(128 + signum)
