"""The scheduler: which requests run this step, and how many tokens each.

Pure CPU bookkeeping (no torch), after vLLM V1's scheduler: there are no prefill and decode
phases. Every request has ``num_computed_tokens`` and ``num_tokens``; each step gives each
request ``num_tokens - num_computed_tokens`` new tokens (capped by the step's token budget), so
a long prompt is chunked over steps and decodes of other requests ride along. Running requests
go first; when the KV pool runs out, the newest running request is preempted (its blocks freed,
recomputed later); waiting requests are admitted only if no request was preempted this step.
"""

from __future__ import annotations

import logging
from collections import deque

from mm_serve.cache import KVCacheManager
from mm_serve.config import CacheConfig, SchedulerConfig
from mm_serve.request import Request, RequestStatus
from mm_serve.sched.output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns the request queues and the KV cache manager of one engine core.

    Args:
        scheduler_config: the per-step budgets.
        cache_config: block size and prefix caching switch.
        num_kv_blocks: size of the KV pool in blocks, found by the model runner's profiling.
    """

    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_kv_blocks: int
    ) -> None:
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks=num_kv_blocks,
            block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished since the last schedule(); the runner drops their state.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0  # since start-up, for stats and tests

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request.

        Raises:
            ValueError: if the prompt can never fit (model length or the whole KV pool).
        """
        max_len = self.config.max_model_len
        if request.num_prompt_tokens >= max_len:
            raise ValueError(
                f"The prompt has {request.num_prompt_tokens} tokens, but the model's maximum "
                f"length is {max_len} (prompt and at least one output token)."
            )
        blocks_needed = -(-(request.num_prompt_tokens + 1) // self.block_size)
        if blocks_needed > self.kv_cache_manager.num_blocks:
            raise ValueError(
                f"The prompt needs {blocks_needed} KV blocks but the cache holds only "
                f"{self.kv_cache_manager.num_blocks}; raise the KV cache size."
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Finish (usually abort) requests wherever they are; unknown ids are ignored."""
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request in self.running:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step: running requests first, then waiting ones, within the budgets."""
        token_budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs = CachedRequestData()

        token_budget, preempted = self._schedule_running(token_budget, num_scheduled, cached_reqs)
        if not preempted:
            self._schedule_waiting(token_budget, num_scheduled, new_reqs, cached_reqs)

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
        )
        # The scheduled tokens count as computed from now on: their KV is written this step.
        for req_id, num_tokens in num_scheduled.items():
            self.requests[req_id].num_computed_tokens += num_tokens
        self.finished_req_ids = set()
        return output

    def _schedule_running(
        self, token_budget: int, num_scheduled: dict[str, int], cached_reqs: CachedRequestData
    ) -> tuple[int, list[Request]]:
        preempted: list[Request] = []
        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, token_budget)
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            while new_blocks is None:
                # Out of KV blocks: preempt the newest running request and retry.
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is None:
                break
            cached_reqs.add(request, [b.block_id for b in new_blocks], resumed=False)
            num_scheduled[request.request_id] = num_new
            token_budget -= num_new
            index += 1
        return token_budget, preempted

    def _schedule_waiting(
        self,
        token_budget: int,
        num_scheduled: dict[str, int],
        new_reqs: list[NewRequestData],
        cached_reqs: CachedRequestData,
    ) -> None:
        kv = self.kv_cache_manager
        while self.waiting and token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            computed_blocks, num_computed = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and num_new > token_budget:
                break
            num_new = min(num_new, token_budget)
            if kv.allocate_slots(request, num_new, num_computed, computed_blocks) is None:
                break  # No room; the waiting queue stays in order (FCFS).
            self.waiting.popleft()
            self.running.append(request)
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            block_ids = kv.get_block_ids(request.request_id)
            if request.status == RequestStatus.PREEMPTED:
                cached_reqs.add(request, block_ids, resumed=True)
            else:
                new_reqs.append(NewRequestData.from_request(request, block_ids))
            request.status = RequestStatus.RUNNING
            num_scheduled[request.request_id] = num_new
            token_budget -= num_new

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the KV and start the request over later."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.debug("preempted %s", request.request_id)

    # ---- after the forward pass -----------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests."""
        outputs: list[EngineCoreOutput] = []
        for index, req_id in enumerate(runner_output.req_ids):
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            new_token_ids = runner_output.sampled_token_ids[index]
            logprobs = runner_output.logprobs[index]
            for count, token_id in enumerate(new_token_ids, start=1):
                request.append_output_token_ids([token_id])
                if self._check_stop(request):
                    del new_token_ids[count:]
                    break
            prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            if new_token_ids or prompt_logprobs or request.is_finished:
                outputs.append(self._make_output(request, new_token_ids, logprobs, prompt_logprobs))
            if request.is_finished:
                self.running.remove(request)
                self._free_request(request)
        return outputs

    def _check_stop(self, request: Request) -> bool:
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last
                return True
        max_tokens = params.max_tokens or self.config.max_model_len
        if (
            request.num_output_tokens >= max_tokens
            or request.num_tokens >= self.config.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _make_output(self, request, new_token_ids, logprobs, prompt_logprobs) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=list(new_token_ids),
            new_logprobs=[logprobs] if logprobs is not None and new_token_ids else None,
            new_prompt_logprobs=prompt_logprobs,
            finish_reason=RequestStatus.finish_reason(request.status),
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
