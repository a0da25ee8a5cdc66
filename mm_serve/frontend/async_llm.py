"""The API server's front end of the engine: prompts in, streamed completions out (asyncio).

``AsyncLLM`` ties the front end it shares with the offline ``LLM`` (``FrontEnd``) to an event
loop: the ``InputProcessor`` (chat template, tokenization, image hashing) runs in one worker
thread, never on the event loop; images are preprocessed by its process pool; the engine core
runs in its own process behind an ``AsyncEngineCoreClient`` (with data parallelism, several
replicas behind an ``AsyncDataParallelClient``); the ``OutputProcessor`` turns its outputs into
streamed deltas on the loop as they arrive.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from mm_serve.config import EngineArgs
from mm_serve.frontend.base import FrontEnd
from mm_serve.frontend.beam_search import BeamSearch, to_request_output
from mm_serve.frontend.dp_client import make_engine_core_client
from mm_serve.frontend.engine_process import EngineProcess
from mm_serve.frontend.output_processor import ParentRequest
from mm_serve.frontend.processor import PendingPrompt, ProcessedPrompt, PromptType
from mm_serve.frontend.warm_up import (
    warm_up_batch_size,
    warm_up_image_size,
    warm_up_params,
    warm_up_prompt,
)
from mm_serve.lora.request import LoRARequest
from mm_serve.messages.outputs import EmbeddingRequestOutput, Logprob, RequestOutput
from mm_serve.messages.pooling_params import PoolingParams
from mm_serve.messages.request import Request
from mm_serve.messages.sampling_params import BeamSearchParams, SamplingParams
from mm_serve.messages.stats import EngineStats, RequestStats

logger = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncLLM(FrontEnd):
    """The engine for one event loop: process prompts, generate, abort, read the counters.

    The constructor blocks while the engine core process starts and loads the model (seconds
    to minutes); from a running loop, use ``await AsyncLLM.create(...)``. Call ``shutdown()``
    when done: it stops the engine core and the preprocessing pool.

    Args:
        engine_args: every engine option (``mm_serve.config.EngineArgs``).
        on_request_finished: called on the loop with each completion's ``RequestStats`` when
            it finishes, is cancelled or fails (for metrics); must not raise.
        on_inter_token_latency: called on the loop with each inter-token latency (ITL, in
            seconds: between two outputs of a completion that bring tokens); must not raise.
        engine_process: the engine core process, if started already (``start_engine_core``).

    Raises:
        ValueError: an unusable checkpoint or option.
        EngineStartupError: the engine core process failed to start.
    """

    def __init__(
        self,
        engine_args: EngineArgs,
        on_request_finished: Callable[[RequestStats], None] | None = None,
        on_inter_token_latency: Callable[[float], None] | None = None,
        engine_process: EngineProcess | None = None,
    ) -> None:
        # The engine core process first: it imports the engine while the config is resolved.
        self.engine_core = make_engine_core_client(engine_args, True, engine_process)
        super().__init__(engine_args, self.engine_core)
        # One thread: HF fast tokenizers are not safe to call from several threads at once.
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="mm_serve-tokenizer"
        )
        try:
            # The preprocessing workers start (and warm up) while the engine core loads.
            self._workers_ready = self.start_preprocessing()
            self.engine_core.start(self.config)
        except BaseException:
            self.engine_core.shutdown()
            self._tokenizer_thread.shutdown(wait=False)
            self.input_processor.shutdown()
            raise
        self.on_request_finished = on_request_finished
        self.output_processor.on_inter_token_latency = on_inter_token_latency
        logger.info(
            "The engine core is running (pid %s).", ", ".join(map(str, self.engine_core.pids))
        )

    @classmethod
    async def create(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        """Build an ``AsyncLLM`` in a worker thread, keeping the running loop free."""
        return await asyncio.to_thread(cls, engine_args, **kwargs)

    async def warm_up(self, through_engine: bool = True) -> None:
        """Run the warm-up requests (``mm_serve.frontend.warm_up``: a batch filling the largest
        step on CUDA, one request elsewhere; the same on each data-parallel replica) once the
        preprocessing workers are warm, then reset the engine core; the metrics' callbacks
        never hear of them. ``through_engine`` False: only process one prompt (tokenizer and
        preprocessing pool), for an API server whose engine core another one warms up.

        Raises:
            BrokenProcessPool: a preprocessing worker failed to start.
            ValueError, EngineRequestError: the checkpoint cannot serve the request.
            EngineDeadError: the engine core is gone.
        """
        start = time.perf_counter()
        await asyncio.gather(*(asyncio.wrap_future(f) for f in self._workers_ready))
        image_size = warm_up_image_size(self.config)

        async def one_prompt() -> ProcessedPrompt:
            prompt = await self._in_tokenizer_thread(
                warm_up_prompt, self.input_processor, image_size
            )
            return await self.process(prompt)

        async def run(prompt: ProcessedPrompt, replica: int) -> None:
            request_id = f"warm-up-{uuid.uuid4()}"
            params = warm_up_params(self.config)
            async for _ in self.generate(prompt, params, request_id, None, replica):
                pass

        first = await one_prompt()
        if not through_engine:
            return
        num_prompts = warm_up_batch_size(self.config, len(first.token_ids))
        replicas = self.config.parallel.data_parallel_size
        logger.info("Warming up: %d request(s) through the whole path", num_prompts * replicas)
        count = num_prompts * replicas - 1
        prompts = [first, *await asyncio.gather(*(one_prompt() for _ in range(count)))]
        processor = self.output_processor
        callbacks = self.on_request_finished, processor.on_inter_token_latency
        self.on_request_finished = processor.on_inter_token_latency = None
        try:
            await asyncio.gather(*(run(p, i % replicas) for i, p in enumerate(prompts)))
        finally:
            self.on_request_finished, processor.on_inter_token_latency = callbacks
        await self.engine_core.reset()
        logger.info("Warmed up in %.1f s", time.perf_counter() - start)

    @property
    def is_dead(self) -> bool:
        """True once the engine core process is gone: nothing more can be served."""
        return self.engine_core.is_dead

    @property
    def max_model_len(self) -> int:
        """Prompt + output length limit, in tokens."""
        return self.config.model.max_model_len

    async def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict:
        """Render OpenAI-style messages into a prompt dict (``InputProcessor.apply_chat_
        template``), in the tokenizer thread.

        Raises:
            ValueError: the messages are malformed or the chat template rejects them (the
                template's own message, e.g. roles that must alternate).
        """
        return await self._in_tokenizer_thread(self._render, messages, kwargs)

    async def with_tokenizer(self, fn: Callable[[Any], T]) -> T:
        """``fn(tokenizer)`` in the tokenizer thread (HF fast tokenizers are not thread-safe)."""
        return await self._in_tokenizer_thread(fn, self.input_processor.tokenizer)

    async def process(self, prompt: PromptType, add_special_tokens: bool = True) -> ProcessedPrompt:
        """Tokenize a prompt and submit its images (in the tokenizer thread), wait for them to
        come out of the preprocessing pool (without blocking the loop), and expand their
        placeholders (in the tokenizer thread again, unless no image had to wait).
        ``add_special_tokens``: see ``InputProcessor.process``.

        Raises:
            ValueError: see ``InputProcessor.process`` and ``PendingPrompt.result``.
        """
        return await self._finish_processing(
            await self._in_tokenizer_thread(self._start_processing, prompt, add_special_tokens)
        )

    async def process_chat(
        self,
        messages: list[dict[str, Any]],
        cache_salt: str | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> ProcessedPrompt:
        """``apply_chat_template`` (with ``kwargs``) and ``process`` in one: rendering,
        tokenizing and submitting the images are one call in the tokenizer thread. The
        prompt's images are preprocessed with ``mm_processor_kwargs`` on top of the server's.

        Raises:
            ValueError: as ``apply_chat_template`` and ``process``.
        """

        def start() -> PendingPrompt | ProcessedPrompt:
            prompt = self._render(messages, kwargs)
            if cache_salt is not None:
                prompt["cache_salt"] = cache_salt
            if mm_processor_kwargs is not None:
                prompt["mm_processor_kwargs"] = mm_processor_kwargs
            return self._start_processing(prompt)

        return await self._finish_processing(await self._in_tokenizer_thread(start))

    def _render(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> dict:
        """``InputProcessor.apply_chat_template``; a template error becomes a ValueError."""
        from jinja2 import TemplateError

        try:
            return self.input_processor.apply_chat_template(messages, **kwargs)
        except TemplateError as e:
            raise ValueError(f"The chat template could not render the messages: {e}") from e

    def _start_processing(
        self, prompt: PromptType, add_special_tokens: bool = True
    ) -> PendingPrompt | ProcessedPrompt:
        """In the tokenizer thread: the processed prompt if no image has to wait, else the
        pending one."""
        pending = self.input_processor.process(prompt, add_special_tokens)
        return pending.result() if pending.done() else pending

    async def _finish_processing(self, item: PendingPrompt | ProcessedPrompt) -> ProcessedPrompt:
        if isinstance(item, ProcessedPrompt):
            return item
        for image in item.images.items:
            if isinstance(image, concurrent.futures.Future):
                # Shielded: the pool's future may be shared with other requests, and a
                # cancelled waiter must not cancel it.
                await asyncio.shield(asyncio.wrap_future(image))
        return await self._in_tokenizer_thread(item.result)

    async def generate(
        self,
        prompt: ProcessedPrompt,
        params: SamplingParams | PoolingParams,
        request_id: str,
        arrival_time: float | None = None,
        data_parallel_rank: int | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Run one request; yields deltas until every one of its ``n`` completions finished.

        Each ``RequestOutput`` lists only the completions with news, and each of them holds
        the text, token ids and logprobs *new since the previous output* (the
        ``cumulative_logprob`` is the running total); a completion appears once more with
        its ``finish_reason``. ``finished`` is True on the last output. Closing the iterator
        early (the client went away; ``asyncio.CancelledError``) aborts the request in the
        engine core, which frees its KV blocks and encoder-cache references.

        With ``PoolingParams`` (the pooling runner; see ``encode``) it yields one
        ``EmbeddingRequestOutput`` once the embedding is computed.

        ``arrival_time``: ``time.monotonic()`` when the request arrived (TTFT is measured from
        it); now when None. ``data_parallel_rank``: the replica to run it (None: the router's
        choice, by load and cache affinity). ``priority``: lower runs first under
        ``--scheduling-policy priority``. ``lora_request``: the LoRA adapter (None: the base
        model; the engine needs ``enable_lora``).

        Raises:
            ValueError: ``request_id`` is already in flight, or the engine's runner does not
                serve the request (``FrontEnd.check_runner``; raised before the first output);
                a ``LoRAAdapterError`` for an adapter that cannot be served.
            EngineRequestError: the engine refused the request (a ``ValueError``: a 4xx unless
                its ``kind`` is "internal").
            EngineDeadError: the engine core process is gone (within ~0.1 s of its death).
        """
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        parent, requests = self.make_requests(
            request_id, prompt, params, stream=True, lora_request=lora_request
        )
        for request in requests:
            request.priority = priority
        outcome = ""
        try:
            engine_outputs = await self.engine_core.add_requests(requests, data_parallel_rank)
            while not parent.finished:
                items = [await engine_outputs.get()]
                while not engine_outputs.empty():
                    items.append(engine_outputs.get_nowait())
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                outputs, to_abort = self.output_processor.process_outputs(items, time.monotonic())
                if to_abort:
                    await self.engine_core.abort_requests(to_abort)
                for output in outputs:
                    yield output
        except BaseException as e:
            cancelled = isinstance(e, (GeneratorExit, asyncio.CancelledError))
            outcome = "abort" if cancelled else "error"
            raise
        finally:
            await self._finish(requests, parent, arrival_time, outcome)

    async def encode(
        self,
        prompt: ProcessedPrompt,
        params: PoolingParams,
        request_id: str,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> EmbeddingRequestOutput:
        """The embedding of one prompt (vLLM's ``encode``, the pooling runner): ``generate``
        with ``params``, its one output. Cancelling it aborts the request.

        Raises:
            as ``generate``; ``InvalidParamError`` naming ``dimensions``
            (``resolve_pooling_params``).
        """
        outputs = self.generate(prompt, params, request_id, arrival_time, priority=priority)
        return [output async for output in outputs][-1]

    async def beam_search(
        self,
        prompt: ProcessedPrompt,
        params: BeamSearchParams,
        request_id: str,
        num_logprobs: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Beam search over one prompt (``mm_serve.frontend.beam_search``): each round, one engine
        request per live beam, all at once (they share their prefix's KV blocks through the
        prefix cache). Yields one finished ``RequestOutput`` at the end, as vLLM's server does:
        completion ``i`` is the ``i``-th best sequence, with the per-token logprobs of its top
        candidates (at least ``num_logprobs`` of them, for a response's top logprobs). Every
        beam runs with the adapter ``lora_request`` (None: the base model).

        Raises:
            as ``generate``; an error in one beam's request cancels the round's others.
        """
        stop_token_ids = self.input_processor.stop_token_ids
        search = BeamSearch(prompt, params, stop_token_ids, self.config.model)
        sampling_params = search.sampling_params(num_logprobs)
        round_index = 0
        while not search.done:
            ids = [f"{request_id}-{round_index}-{i}" for i in range(len(search.running))]
            tasks = [
                asyncio.ensure_future(
                    self._next_logprobs(beam, sampling_params, beam_id, lora_request)
                )
                for beam, beam_id in zip(search.requests(), ids, strict=True)
            ]
            try:
                search.advance(await asyncio.gather(*tasks))
            finally:
                for task in tasks:
                    task.cancel()
            round_index += 1
        output = await self.with_tokenizer(search.output)  # decodes the sequences
        yield to_request_output(request_id, prompt, output)

    async def _next_logprobs(
        self,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None,
    ) -> dict[int, Logprob]:
        """The logprobs of the one token a ``max_tokens=1`` request generates."""
        logprobs: list[dict[int, Logprob]] = []
        async for output in self.generate(prompt, params, request_id, lora_request=lora_request):
            for delta in output.outputs:
                logprobs += delta.logprobs or []
        return logprobs[0]

    async def _finish(
        self, requests: list[Request], parent: ParentRequest, arrival_time: float, outcome: str
    ) -> None:
        """Abort what is still running in the engine and report each completion's stats."""
        children = zip(requests, parent.children, strict=True)
        unfinished = [request.request_id for request, child in children if not child.finished]
        self.output_processor.abort_requests(unfinished)
        if unfinished and not self.engine_core.is_dead:
            # Never suspends (a socket send), as it must: this runs while the generator is
            # being closed, where an await that yields to the loop is an error.
            await self.engine_core.abort_requests(unfinished)
        if self.on_request_finished is None:
            return
        now = time.monotonic()
        for child in parent.children:
            stats = RequestStats(
                index=child.index,
                finish_reason=child.finish_reason or outcome or "abort",
                num_prompt_tokens=len(parent.prompt_token_ids),
                num_output_tokens=len(child.token_ids),
                arrival_time=arrival_time,
                finished_time=now,
                times=child.times,
                request_id=parent.request_id,
            )
            self.on_request_finished(stats)

    async def get_stats(self) -> EngineStats:
        """The engine core's counters plus the front end's processor-cache counters.

        Raises:
            EngineDeadError: the engine core is gone.
        """
        return self.add_front_end_stats(await self.engine_core.get_stats())

    async def get_replica_stats(self) -> list[EngineStats]:
        """Each data-parallel replica's counters (one without data parallelism), each with the
        front end's processor-cache counters.

        Raises:
            EngineDeadError: an engine core is gone.
        """
        return [self.add_front_end_stats(s) for s in await self.engine_core.get_replica_stats()]

    async def start_profile(self) -> None:
        """Start the torch profiler in the engine's processes (``mm_serve.utils.profiler``).

        Raises:
            RuntimeError: ``MM_SERVE_TORCH_PROFILER_DIR`` is unset, or the profiler runs.
            EngineDeadError: the engine core is gone.
        """
        await self.engine_core.start_profile()

    async def stop_profile(self) -> None:
        """Stop the profiler; each of the engine's processes writes its trace.

        Raises:
            RuntimeError: the profiler is not running.
            EngineDeadError: the engine core is gone.
        """
        await self.engine_core.stop_profile()

    def shutdown(self) -> None:
        """Stop the engine core process, the preprocessing pool and the tokenizer thread;
        in-flight requests fail with ``EngineDeadError``. Idempotent."""
        self.engine_core.shutdown()
        self.input_processor.shutdown()
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    async def _in_tokenizer_thread(self, fn: Callable[..., Any], *args: Any):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)
