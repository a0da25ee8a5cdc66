"""The engine core: the scheduler and the model runner, one step at a time."""

from __future__ import annotations

import logging

from mm_serve.config import EngineConfig
from mm_serve.request import Request, RequestStatus
from mm_serve.sched.output import EngineCoreOutput
from mm_serve.sched.scheduler import Scheduler
from mm_serve.stats import EngineStats
from mm_serve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    """Loads the model, sizes the KV cache, then runs ``step()`` while requests remain."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_runner = ModelRunner(config)
        self.model_runner.load_model()
        num_kv_blocks = self.model_runner.determine_num_kv_blocks()
        self.model_runner.initialize_kv_cache(num_kv_blocks)
        self.model_runner.capture_cuda_graphs()  # decode steps; a no-op on CPU / enforce_eager
        self.scheduler = Scheduler(config.scheduler, config.cache, num_kv_blocks)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_stats(self) -> EngineStats:
        """Counters of the scheduler and its caches (processor-cache counts are the front end's)."""
        return self.scheduler.make_stats()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute, update: one forward pass over the batch the scheduler chose."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_runner.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)
