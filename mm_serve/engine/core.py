"""The engine core: the scheduler and the model runner, one step at a time."""

from __future__ import annotations

import collections
import functools
import logging

from mm_serve.cache.kv_cache_groups import kv_cache_layout
from mm_serve.config import EngineConfig
from mm_serve.config.parallel import check_tensor_parallel
from mm_serve.messages.outputs import EngineCoreOutput
from mm_serve.messages.request import Request, RequestStatus
from mm_serve.messages.stats import EngineStats, IterationTokens
from mm_serve.sched.output import SchedulerOutput
from mm_serve.sched.scheduler import Scheduler
from mm_serve.sched.structured_output import GrammarBitmask, StructuredOutputManager
from mm_serve.utils.profiler import TorchProfiler
from mm_serve.worker.model_runner import ModelRunner
from mm_serve.worker.step_output import PendingOutput

logger = logging.getLogger(__name__)


class EngineCore:
    """Loads the model, sizes the KV cache, then runs ``step()`` while requests remain.

    With ``async_scheduling`` (on by default on CUDA) a step launches the next forward pass
    before it reads the previous one's tokens, so scheduling and input preparation on the host
    overlap the device's work; each ``step()`` then returns the outputs of the step before.

    Unless ``distributed_executor_backend`` is "uni" (the default at one rank),
    ``model_runner`` is a ``MultiprocExecutor`` (same methods): one worker process per rank,
    each with its shard and its own ``ModelRunner`` (a ``RayExecutor``, Ray actors, with
    "ray"). With async scheduling each ``step()`` then returns the outputs of the step two
    before it.

    Raises (from the constructor):
        ValueError: the model does not split over ``config.parallel.tensor_parallel_size``
            ranks (``parallel_config.check_tensor_parallel``).
        WorkerDiedError: a tensor-parallel worker failed (also from ``step()``).
    """

    def __init__(self, config: EngineConfig) -> None:
        tp_size = config.parallel.tensor_parallel_size
        check_tensor_parallel(config.model.hf_config, tp_size)  # a config built by hand
        self.config = config
        if config.parallel.distributed_executor_backend == "uni":
            self.model_runner = ModelRunner(config)
            self.model_runner.load_model()
        elif config.parallel.distributed_executor_backend == "ray":  # Ray only when used
            from mm_serve.engine.ray_executor import RayExecutor

            self.model_runner = RayExecutor(config)  # the workers load their shards
        else:  # ZeroMQ and the workers only when used
            from mm_serve.engine.executor import MultiprocExecutor

            self.model_runner = MultiprocExecutor(config)
        self.num_kv_blocks = self.model_runner.determine_num_kv_blocks()
        self.model_runner.initialize_kv_cache(self.num_kv_blocks)
        self.model_runner.capture_cuda_graphs()  # a no-op on CPU / enforce_eager
        self.structured_output = StructuredOutputManager(
            config.model, pin_memory=config.device.type == "cuda"
        )
        self.scheduler = self._make_scheduler()
        # Steps left launched and unread after each step (async scheduling): one when the
        # runner is in this process; two when it is a worker process, so that the worker
        # prepares a step while this process schedules the next.
        self.max_in_flight = 0
        if config.scheduler.async_scheduling:
            self.max_in_flight = 1 if config.parallel.distributed_executor_backend == "uni" else 2
        self._in_flight: collections.deque[tuple[SchedulerOutput, PendingOutput]] = (
            collections.deque()
        )
        # For the metrics: the tokens scheduled per step.
        self.iteration_tokens = IterationTokens()
        self.profiler = TorchProfiler("engine-core")

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def add_requests(self, requests: list[Request]) -> None:
        """Add requests in order: the ``n`` siblings of one user request (a remote engine core
        receives them in one message)."""
        for request in requests:
            self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_stats(self) -> EngineStats:
        """Counters of the scheduler and its caches, and the tokens per step (processor-cache
        counts are the front end's)."""
        return self.iteration_tokens.add_to(self.scheduler.make_stats())

    def start_profile(self) -> None:
        """Start the torch profiler (``mm_serve.utils.profiler``) in this process and in each
        tensor-parallel worker process.

        Raises:
            RuntimeError: ``MM_SERVE_TORCH_PROFILER_DIR`` is unset, or the profiler runs.
            ValueError: an unknown name in ``MM_SERVE_TORCH_PROFILER_ACTIVITIES``.
        """
        self.profiler.start()
        if self.config.parallel.distributed_executor_backend != "uni":
            self.model_runner.start_profile()

    def stop_profile(self) -> None:
        """Stop the profilers ``start_profile`` started; each process writes its trace.
        Raises RuntimeError when profiling is off or not running."""
        self.profiler.stop()
        if self.config.parallel.distributed_executor_backend != "uni":
            self.model_runner.stop_profile()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute, update: one forward pass over the batch the scheduler chose.

        With async scheduling the update is that of an earlier step, whose tokens the
        scheduler treated as placeholders while it scheduled this one (``max_in_flight``).
        """
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens:
            self.iteration_tokens.observe(scheduler_output.total_num_scheduled_tokens)
        outputs, bitmask = [], None
        if scheduler_output.structured_output_request_ids:
            # The bitmask needs every earlier token: at most the last step may be in flight.
            outputs = self._update_in_flight(keep=1)
            previous = self._in_flight[0] if self._in_flight else None
            bitmask = functools.partial(self._grammar_bitmask, scheduler_output, previous)
        pending = self.model_runner.execute_model(scheduler_output, bitmask)
        self._in_flight.append((scheduler_output, pending))
        return outputs + self._update_in_flight(keep=self.max_in_flight)

    def _update_in_flight(self, keep: int) -> list[EngineCoreOutput]:
        """Read the oldest launched steps' tokens and update the scheduler with them, until
        ``keep`` steps are left in flight."""
        outputs = []
        while len(self._in_flight) > keep:
            scheduler_output, pending = self._in_flight.popleft()
            outputs += self.scheduler.update_from_output(scheduler_output, pending.get())
        return outputs

    def _grammar_bitmask(
        self, scheduler_output: SchedulerOutput, previous: tuple | None
    ) -> GrammarBitmask:
        """The bitmask of the step's grammar requests, which the runner asks for between the
        step's forward pass and its sampling: it needs every earlier token, so the previous
        step's go into the matchers now (the forward pass keeps the device busy); the rest of
        that step's update follows once sampling is queued."""
        requests = self.scheduler.requests
        if previous is not None:
            self.structured_output.accept_tokens(previous[1].get(), requests)
        return self.structured_output.grammar_bitmask(scheduler_output, requests)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to stop with one rank); idempotent."""
        self.model_runner.shutdown()

    def reset(self) -> None:
        """Forget what finished requests left behind, as after start-up: the prefix cache's
        block hashes, the encoder cache's entries and the scheduler's counters (after the
        start-up warm-up request, so that nothing a user sends hits it or is counted with it).

        Raises:
            RuntimeError: requests are still unfinished.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("Cannot reset the engine core while requests are unfinished.")
        self._update_in_flight(keep=0)  # the last launched steps (async scheduling)
        # An empty step hands the runner the finished requests, whose states it then drops.
        self.model_runner.execute_model(self.scheduler.schedule())
        self.model_runner.reset_encoder_cache()
        self.scheduler = self._make_scheduler()
        self.iteration_tokens = IterationTokens()

    def _make_scheduler(self) -> Scheduler:
        config = self.config
        layout = kv_cache_layout(config.model.hf_config)
        max_loras = 0 if config.lora is None else config.lora.max_loras
        return Scheduler(
            config.scheduler,
            config.cache,
            self.num_kv_blocks,
            self.structured_output,
            layout,
            max_loras,
        )
