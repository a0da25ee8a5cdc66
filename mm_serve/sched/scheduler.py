"""The scheduler: which requests run this step, and how many tokens each.

Pure CPU bookkeeping (no torch), after vLLM V1's scheduler: no prefill and decode phases. Each
step gives each request ``num_tokens - num_computed_tokens`` new tokens within the step's token
budget, so long prompts are chunked and decodes ride along. Running requests go first; when the
KV pool runs out, the newest running request is preempted (blocks freed, recomputed later);
waiting requests are admitted only if no request was preempted this step. Under the
"priority" policy (vLLM's) the waiting queue is ordered by ``(priority, arrival_time)``, lower
first, and the running request of the largest such key is the one preempted.

An image whose placeholder range enters a request's window is encoded this step unless its
embeddings are cached or its range is covered by computed (or prefix-cached) KV. Encoding spends
the encoder budget and encoder-cache space; an image that does not fit ends the request's chunk
just before it.

Async scheduling: step n+1 is scheduled before step n's tokens are known. A request reaching
its end gets an output placeholder; ``update_from_output`` replaces it with the real token and
applies the stop conditions. A request whose last allowed token is in flight gets no more work;
one preempted with a token in flight waits for it.

Pooling (embedding) requests run their prompt like any other and finish in the step whose
output holds their embedding (``ModelRunnerOutput.pooler_output``).

Structured outputs: a request with a grammar waits until it is compiled
(``StructuredOutputManager``); its matcher follows every appended token, and the manager's
``grammar_bitmask`` gives the tokens it may sample next.

LoRA: a step's requests use at most ``max_loras`` distinct adapters (the worker's slots). A
waiting request whose adapter would be one too many is set aside, in order, while the queue
behind it goes on (vLLM's rule); base-model requests never wait for slots."""

from __future__ import annotations

import logging
import time
from collections import deque

from mm_serve.cache.encoder_cache_manager import EncoderCacheManager
from mm_serve.cache.kv_cache_groups import KVCacheLayout
from mm_serve.cache.kv_cache_manager import KVCacheManager
from mm_serve.config import CacheConfig, SchedulerConfig
from mm_serve.messages.outputs import EngineCoreOutput
from mm_serve.messages.request import FINISH_REASONS, LAST_UNFINISHED, Request, RequestStatus
from mm_serve.messages.stats import EngineStats
from mm_serve.sched.encoder_inputs import (
    check_images_fit,
    free_consumed_encoder_inputs,
    schedule_encoder_inputs,
)
from mm_serve.sched.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    StepDecisions,
)
from mm_serve.sched.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns the request queues and the KV cache manager of one engine core.

    Args:
        scheduler_config: the per-step budgets.
        cache_config: block size and prefix caching switch.
        num_kv_blocks: size of the KV pool in blocks (``ModelRunner.determine_num_kv_blocks``).
        structured_output: compiles grammars; None refuses requests with ``structured_outputs``.
        kv_cache_layout: the model's KV-cache groups (``cache.kv_cache_groups``); None: one.
        max_loras: distinct LoRA adapters per step; 0: LoRA off (adapter requests refused).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        structured_output: StructuredOutputManager | None = None,
        kv_cache_layout: KVCacheLayout | None = None,
        max_loras: int = 0,
    ) -> None:
        self.config = scheduler_config
        self.max_loras = max_loras
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_kv_blocks,
            cache_config.block_size,
            kv_cache_layout,
            enable_caching=cache_config.enable_prefix_caching,
        )
        self.encoder_cache_manager = EncoderCacheManager(scheduler_config.encoder_cache_size)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.structured_output = structured_output
        # Finished since the last schedule(); the runner drops their state.
        self.finished_req_ids: set[str] = set()
        # Requests that failed before running (their grammar did not compile): reported by the
        # next update_from_output.
        self.failed_outputs: list[EngineCoreOutput] = []
        self.num_preemptions = 0  # since start-up, for stats and tests
        self.prefix_cache_queries = 0  # tokens, since start-up
        self.prefix_cache_hits = 0

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
        blocks_needed = self.kv_cache_manager.blocks_needed(request.num_prompt_tokens + 1)
        if blocks_needed > self.kv_cache_manager.num_blocks:
            raise ValueError(
                f"The prompt needs {blocks_needed} KV blocks but the cache holds only "
                f"{self.kv_cache_manager.num_blocks}; raise the KV cache size."
            )
        check_images_fit(self.config, request)
        if request.priority and self.config.scheduling_policy != "priority":
            raise ValueError(
                "priority needs the priority scheduling policy (--scheduling-policy priority)."
            )
        if request.lora_request is not None and not self.max_loras:
            raise ValueError("LoRA adapters need an engine started with enable_lora.")
        request.max_num_tokens = min(request.max_num_tokens, max_len)
        if request.sampling_params.structured_outputs is not None:
            if self.structured_output is None:
                raise ValueError("This engine does not serve structured outputs.")
            self.structured_output.add_request(request)
        self.requests[request.request_id] = request
        self._queue(request, first=False)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Finish (usually abort) requests wherever they are; unknown ids are ignored."""
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            request.status = status
            self._free_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.failed_outputs)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step: running requests first, then waiting ones, within the budgets."""
        step = StepDecisions(
            self.config.max_num_batched_tokens, self.config.max_num_encoder_input_tokens
        )
        if not self._schedule_running(step):
            self._schedule_waiting(step)
        output = SchedulerOutput(
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=CachedRequestData.from_rows(step.cached_rows),
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - step.token_budget,
            finished_req_ids=self.finished_req_ids,
            scheduled_encoder_inputs=step.encoder_inputs,
            free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
            structured_output_request_ids=step.structured_output_request_ids,
        )
        self.finished_req_ids = set()
        return output

    def _schedule_running(self, step: StepDecisions) -> list[Request]:
        """Schedule running requests; returns those preempted to make room.

        A request that decodes one token into slots it holds (``KVCacheManager.slot_limit``)
        takes the fast path: no allocation, no image, no grammar, a few integer updates."""
        preempted: list[Request] = []
        slot_limits = self.kv_cache_manager.slot_limits
        num_scheduled, cached_rows = step.num_scheduled, step.cached_rows
        running = self.running
        index = 0
        while index < len(running) and step.token_budget > 0:
            request = running[index]
            index += 1
            # Its tokens and the ones in flight (placeholders) against where it stops.
            num_tokens = len(request.all_token_ids) + request.num_output_placeholders
            if num_tokens >= request.max_num_tokens:
                continue  # the step in flight samples its last token: no more work
            num_computed = request.num_computed_tokens
            if (
                num_tokens - num_computed == 1
                and num_computed < slot_limits.get(request.request_id, 0)
                and request.grammar is None
                and num_computed >= len(request.prompt_token_ids)
            ):
                # A decode step (``_commit`` of one token whose window reaches the end).
                num_scheduled[request.request_id] = 1
                step.token_budget -= 1
                cached_rows.append((request.request_id, False, [], num_computed))
                request.num_computed_tokens = num_tokens
                request.num_output_placeholders += 1
                continue
            if not self._schedule_one_running(step, request, num_tokens, preempted):
                break
        return preempted

    def _schedule_one_running(
        self, step: StepDecisions, request: Request, num_tokens: int, preempted: list[Request]
    ) -> bool:
        """Schedule a running request's next chunk (prompt, images, new blocks), preempting
        the newest running requests while the KV pool is short (into ``preempted``). Returns
        False when the request itself was preempted: no blocks were left for it."""
        num_computed = request.num_computed_tokens
        num_new = min(num_tokens - num_computed, step.token_budget)
        to_encode: list[int] = []
        if request.mm_features and num_computed < len(request.prompt_token_ids):
            to_encode, num_new = schedule_encoder_inputs(
                self.encoder_cache_manager,
                request,
                num_computed,
                num_new,
                step.encoder_budget,
                self.config.whole_images,
            )
        if num_new == 0:  # its next image waits for encoder budget or cache space
            return True
        allocate_slots = self.kv_cache_manager.allocate_slots
        new_blocks = allocate_slots(request, num_new)
        while new_blocks is None:
            # Out of KV blocks: preempt the newest (lowest priority) running request, retry.
            victim = self._preemption_victim()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
            new_blocks = allocate_slots(request, num_new)
        block_ids = [b.block_id for b in new_blocks] if new_blocks else []
        step.cached_rows.append((request.request_id, False, block_ids, num_computed))
        self._commit(step, request, num_new, to_encode)
        return True

    def _schedule_waiting(self, step: StepDecisions) -> None:
        kv = self.kv_cache_manager
        # Set aside, order kept: grammars still compiling, adapters beyond max_loras.
        set_aside: list[Request] = []
        while (
            self.waiting and step.token_budget > 0 and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            if request.num_output_placeholders:
                break  # preempted with a token in flight: it resumes once the token is known
            if request.grammar is not None and not self._grammar_ready(request):
                if not request.is_finished:  # (one that failed to compile is gone)
                    set_aside.append(self.waiting.popleft())
                continue
            if request.lora_request is not None and not self._lora_fits(request):
                set_aside.append(self.waiting.popleft())
                continue
            computed_blocks, num_computed = kv.get_computed_blocks(request)
            num_wanted = request.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and num_wanted > step.token_budget:
                break
            to_encode, num_new = schedule_encoder_inputs(
                self.encoder_cache_manager,
                request,
                num_computed,
                min(num_wanted, step.token_budget),
                step.encoder_budget,
                self.config.whole_images,
            )
            if num_new == 0 or (not self.config.enable_chunked_prefill and num_new < num_wanted):
                break  # Its first image must wait for the encoder; the queue stays in order.
            if kv.allocate_slots(request, num_new, num_computed, computed_blocks) is None:
                break  # No room; the waiting queue stays in order (FCFS).
            self.waiting.popleft()
            self.running.append(request)
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:  # first scheduled
                request.num_cached_tokens, request.scheduled_time = num_computed, time.monotonic()
            block_ids = kv.get_block_ids(request.request_id)
            if request.status == RequestStatus.PREEMPTED:
                step.cached_rows.append((request.request_id, True, block_ids, num_computed))
            else:
                step.new_reqs.append(NewRequestData.from_request(request, block_ids))
            request.status = RequestStatus.RUNNING
            self._commit(step, request, num_new, to_encode)
        self.waiting.extendleft(reversed(set_aside))

    def _lora_fits(self, request: Request) -> bool:
        """Whether ``request``'s adapter is a running one, or there is room for another."""
        running = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        return request.lora_request.lora_int_id in running or len(running) < self.max_loras

    def _grammar_ready(self, request: Request) -> bool:
        """Whether its grammar is compiled; one that failed to compile finishes the request."""
        try:
            return self.structured_output.is_ready(request)
        except ValueError as e:
            logger.error("Request %s: its grammar did not compile: %s", request.request_id, e)
            request.status = RequestStatus.FINISHED_ABORTED
            self._free_request(request)
            self.failed_outputs.append(self._make_output(request, [], None, None))
            return False

    def _commit(
        self, step: StepDecisions, request: Request, num_new: int, to_encode: list[int]
    ) -> None:
        """Record a scheduled request (after its diff for the runner is made): its tokens, and
        the images it encodes this step. Its tokens count as computed from now on, since their
        KV is written this step; a request whose window reaches its end samples a token,
        unknown until the step is done (a placeholder)."""
        step.num_scheduled[request.request_id] = num_new
        step.token_budget -= num_new
        if to_encode:
            step.encoder_inputs[request.request_id] = to_encode
            for input_id in to_encode:
                self.encoder_cache_manager.allocate(request, input_id)
                request.encoded_mm_hashes.add(request.mm_features[input_id].mm_hash)
                step.encoder_budget -= request.mm_features[input_id].placeholder.length
        request.num_computed_tokens += num_new
        if request.num_computed_tokens == request.num_tokens_with_placeholders:
            request.num_output_placeholders += 1
            if request.grammar is not None:
                step.structured_output_request_ids.append(request.request_id)
        if request.num_cached_images < 0:
            request.count_cached_images()

    def _queue(self, request: Request, first: bool) -> None:
        """Put a request in the waiting queue: first (a preempted one) or last under "fcfs";
        by ``(priority, arrival_time)`` under "priority"."""
        if self.config.scheduling_policy == "fcfs":
            (self.waiting.appendleft if first else self.waiting.append)(request)
            return
        key = (request.priority, request.arrival_time)
        index = next(
            (i for i, r in enumerate(self.waiting) if (r.priority, r.arrival_time) > key),
            len(self.waiting),
        )
        self.waiting.insert(index, request)

    def _preemption_victim(self) -> Request:
        """Take out of ``running`` the request to preempt: the newest, or under "priority" the
        one of the largest ``(priority, arrival_time)``."""
        if self.config.scheduling_policy == "fcfs":
            return self.running.pop()
        victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
        self.running.remove(victim)
        return victim

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the KV and start the request over later."""
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._queue(request, first=True)
        logger.debug("preempted %s", request.request_id)

    # ---- after the forward pass -----------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests."""
        outputs, self.failed_outputs = self.failed_outputs, []
        requests, prompt_logprobs = self.requests, runner_output.prompt_logprobs
        num_scheduled = scheduler_output.num_scheduled_tokens
        for req_id, new_token_ids, logprobs in zip(
            runner_output.req_ids,
            runner_output.sampled_token_ids,
            runner_output.logprobs,
            strict=True,
        ):
            request = requests.get(req_id)
            if request is None or request.status > LAST_UNFINISHED:
                continue  # aborted while the step ran
            request.num_output_placeholders -= len(new_token_ids)
            finished = False
            for count, token_id in enumerate(new_token_ids, start=1):
                request.output_token_ids.append(token_id)
                request.all_token_ids.append(token_id)
                if (
                    token_id in request.stop_check_token_ids
                    or len(request.all_token_ids) >= request.max_num_tokens
                    or request.grammar is not None
                ) and self._check_stop(request, token_id):
                    del new_token_ids[count:]
                    finished = True
                    break
            chunk_logprobs = prompt_logprobs.get(req_id) if prompt_logprobs else None
            if request.mm_features:
                scheduled = num_scheduled.get(req_id, 0)
                free_consumed_encoder_inputs(self.encoder_cache_manager, request, scheduled)
            if new_token_ids or chunk_logprobs or finished:
                outputs.append(self._make_output(request, new_token_ids, logprobs, chunk_logprobs))
            if finished:
                self._free_request(request)
        for req_id, embedding in runner_output.pooler_output.items():
            self._finish_pooling(requests.get(req_id), embedding, outputs)
        return outputs

    def _finish_pooling(
        self, request: Request | None, embedding: list[float], outputs: list[EngineCoreOutput]
    ) -> None:
        """A pooling request's prompt is computed: its embedding finishes it (the token its
        placeholder stood for is never sampled)."""
        if request is None or request.is_finished:
            return  # aborted while the step ran
        request.num_output_placeholders -= 1
        request.status = RequestStatus.FINISHED_STOPPED
        output = self._make_output(request, [], None, None)
        output.pooling_output = embedding
        outputs.append(output)
        self._free_request(request)

    def _check_stop(self, request: Request, last: int) -> bool:
        """Whether ``last``, the token just appended, finishes ``request`` (its status set).
        Only a grammar, a token of ``request.stop_check_token_ids`` or the length can."""
        params = request.sampling_params
        if request.grammar is not None and self.structured_output.accept_token(request, last):
            request.status = RequestStatus.FINISHED_STOPPED  # the output is complete
            return True
        if len(request.output_token_ids) >= params.min_tokens:
            if last == request.eos_token_id and not params.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if params.stop_token_ids and last in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last
                return True
        if len(request.all_token_ids) >= request.max_num_tokens:  # max_tokens, model length
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _make_output(self, request, new_token_ids, logprobs, prompt_logprobs) -> EngineCoreOutput:
        """Its output of the step; ``new_token_ids`` goes in as it is (read only from here on)."""
        num_cached_tokens, num_cached_images = request.num_cached_tokens, request.num_cached_images
        return EngineCoreOutput(  # positional: one per request per step
            request.request_id,
            new_token_ids,
            [logprobs] if logprobs is not None and new_token_ids else None,
            prompt_logprobs,
            FINISH_REASONS.get(request.status),
            request.stop_reason,
            num_cached_tokens if num_cached_tokens > 0 else 0,
            num_cached_images if num_cached_images > 0 else 0,
            request.scheduled_time,
        )

    def _free_request(self, request: Request) -> None:
        """Take a finished request out of its queue (running, or waiting when it was preempted
        while its last token was in flight) and free everything it holds."""
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    # ---- stats ---------------------------------------------------------------------------

    def make_stats(self) -> EngineStats:
        """The scheduler-side counters (cumulative since start-up) and current gauges."""
        kv = self.kv_cache_manager
        prefix = kv.make_prefix_cache_stats()
        self.prefix_cache_queries += prefix.queries
        self.prefix_cache_hits += prefix.hits
        encoder = self.encoder_cache_manager
        return EngineStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=1.0 - kv.num_free_blocks / kv.num_blocks,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            encoder_cache_queries=encoder.hits + encoder.misses,
            encoder_cache_hits=encoder.hits,
            encoder_tokens_computed=encoder.num_encoder_tokens,
            num_encoder_cache_entries=len(encoder.cached),
            encoder_cache_usage=encoder.usage,
        )
