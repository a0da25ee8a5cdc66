"""The offline API in vLLM's shape: ``LLM(model=...)`` with ``generate``, ``chat``, ``embed``."""

from __future__ import annotations

import collections
import itertools
import logging
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from mm_serve.config import EngineArgs, resolve_device
from mm_serve.engine.core import EngineCore
from mm_serve.frontend.base import FrontEnd
from mm_serve.frontend.beam_search import BeamSearch, BeamSearchOutput
from mm_serve.frontend.processor import PendingPrompt, ProcessedPrompt, PromptType
from mm_serve.frontend.warm_up import (
    warm_up_batch_size,
    warm_up_image_size,
    warm_up_params,
    warm_up_prompt,
)
from mm_serve.lora.request import LoRARequest
from mm_serve.messages.outputs import EmbeddingRequestOutput, RequestOutput
from mm_serve.messages.pooling_params import PoolingParams
from mm_serve.messages.sampling_params import BeamSearchParams, SamplingParams
from mm_serve.messages.stats import EngineStats

if TYPE_CHECKING:
    from mm_serve.frontend.remote_core import RemoteEngineCore

logger = logging.getLogger(__name__)

# Prompts submitted to the input processor ahead of the engine in one generate call.
SUBMIT_WINDOW = 32


class LLM(FrontEnd):
    """The engine over a batch of prompts, with vLLM's offline API.

    On CUDA the engine core runs in its own process (as vLLM V1's), so front-end work
    (tokenizing, image preprocessing, detokenizing) never delays a step; elsewhere, and with
    ``multiprocess=False``, in this process (``engine_core`` is then the ``EngineCore``). For a
    VLM, a pool of worker processes preprocesses images. ``shutdown()`` (or garbage collection)
    stops the pool and the engine core process. The workers never run the caller's main script.
    With ``data_parallel_size > 1``, requests go to replicas by load and cache affinity
    (``frontend/dp_client.py``).

    Args:
        model: a checkpoint folder or a Hugging Face hub id.
        multiprocess: run the engine core in its own process (None: on CUDA, or with data
            parallelism, which needs it).
        **engine_args: any ``EngineArgs`` field (``max_num_batched_tokens``, ``dtype``, ...).

    Raises:
        ValueError: on an unusable checkpoint or option (see ``EngineArgs``).
        EngineStartupError: the engine core process failed to start."""

    def __init__(self, model: str, multiprocess: bool | None = None, **engine_args: Any) -> None:
        args = EngineArgs(model=model, **engine_args)
        replicas = args.data_parallel_size > 1 or args.data_parallel_backend != "mp"
        if multiprocess is None:
            multiprocess = replicas or resolve_device(args.device).type == "cuda"
        elif replicas and not multiprocess:
            raise ValueError("Data parallelism runs engine core processes: multiprocess=True.")
        client = None
        if multiprocess:  # first: the process imports the engine while the config is resolved
            from mm_serve.frontend.dp_client import make_engine_core_client  # ZeroMQ when used
            from mm_serve.frontend.remote_core import RemoteEngineCore

            client = make_engine_core_client(args, asynchronous=False)
        super().__init__(args, client)
        # Hold the parts, not self: they stop when this LLM is collected.
        self._finalizers = [weakref.finalize(self, self.input_processor.shutdown)]
        if client is not None:
            self._finalizers.append(weakref.finalize(self, client.shutdown))
        self.start_preprocessing()  # the workers warm up while the model loads
        self.engine_core: EngineCore | RemoteEngineCore
        if client is not None:
            self.engine_core = RemoteEngineCore(self.config, client)
        else:
            self.engine_core = EngineCore(self.config)
            self._finalizers.append(weakref.finalize(self, self.engine_core.shutdown))
        self._request_counter = itertools.count()
        if self.config.device.type == "cuda":
            self._warm_up()

    def _warm_up(self) -> None:
        """The start-up warm-up batch (``mm_serve.frontend.warm_up``), then ``EngineCore.reset``:
        the first ``generate`` runs at the speed of the next."""
        start = time.perf_counter()
        size = warm_up_image_size(self.config)
        first = warm_up_prompt(self.input_processor, size)
        # Its image is then in the processor cache: generate does not preprocess it again.
        prompt_len = len(self.input_processor.process(first).result().token_ids)
        num_prompts = warm_up_batch_size(self.config, prompt_len)
        num_prompts *= self.config.parallel.data_parallel_size  # a batch for each replica
        prompts = [first] + [
            warm_up_prompt(self.input_processor, size) for _ in range(num_prompts - 1)
        ]
        self._run(prompts, warm_up_params(self.config), use_tqdm=False)
        self.engine_core.reset()
        logger.info("Warmed up: %d requests, %.1f s", num_prompts, time.perf_counter() - start)

    def shutdown(self) -> None:
        """Stop the preprocessing pool's worker processes and the engine core process; safe
        to call more than once. Afterwards an image not in the processor cache raises
        RuntimeError, and a multiprocess engine raises EngineDeadError."""
        for finalizer in self._finalizers:
            finalizer()

    def get_stats(self) -> EngineStats:
        """The engine core's counters plus the front end's processor-cache counters."""
        return self.add_front_end_stats(self.engine_core.get_stats())

    def start_profile(self) -> None:
        """Start the torch profiler in the engine's processes (``mm_serve.utils.profiler``: set
        ``MM_SERVE_TORCH_PROFILER_DIR`` first). Raises RuntimeError when it is unset or the
        profiler runs already."""
        self.engine_core.start_profile()

    def stop_profile(self) -> None:
        """Stop the profiler; each of the engine's processes writes its trace into
        ``MM_SERVE_TORCH_PROFILER_DIR``. Raises RuntimeError when it is not running."""
        self.engine_core.stop_profile()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults, overridden by the checkpoint's ``generation_config.json``."""
        return SamplingParams(**self.default_sampling_overrides())

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for each prompt; outputs come back in the prompts' order.
        ``lora_request``: the adapter of every prompt, or one per prompt (None: the base
        model; the engine needs ``enable_lora``).

        Raises:
            ValueError: on a bad prompt (too long, empty, images for a text model, an
                undecodable image) or a list of sampling params (or adapters) whose length
                differs from the prompts'; ``LoRAAdapterError`` for an adapter that cannot be
                served. Every request the call started is aborted then.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, use_tqdm, lora_request)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """The embedding of each prompt (vLLM's ``LLM.embed``; needs ``runner="pooling"``), in
        the prompts' order: ``output.outputs.embedding``, pooled from the prompt's final
        hidden states as the model's pooler config says (``mm_serve.config.pooler``). Prompts
        as ``generate`` takes them, images included.

        Raises:
            ValueError: on a bad prompt (see ``generate``), a model that generates, or
                ``dimensions`` the model does not allow.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return self._run(list(prompts), pooling_params or PoolingParams(), use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations (OpenAI messages),
        with ``lora_request`` as ``generate`` takes it."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            self.input_processor.apply_chat_template(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
            )
            for conversation in conversations
        ]
        return self._run(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search over each prompt (``mm_serve.frontend.beam_search``); prompts as ``generate``
        takes them, images included. Each round runs one engine request per live beam of
        every prompt, all at once; the beams share their prefix's KV blocks through the
        prefix cache. Outputs come back in the prompts' order, each with the ``beam_width``
        best sequences, best first.

        Raises:
            ValueError: on a bad prompt (see ``generate``).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        pending = [self.input_processor.process(prompt) for prompt in prompts]
        stop_token_ids = self.input_processor.stop_token_ids
        model = self.config.model
        searches = [BeamSearch(p.result(), params, stop_token_ids, model) for p in pending]
        with tqdm(total=len(searches), desc="Beam search", disable=not use_tqdm) as bar:
            while live := [search for search in searches if not search.done]:
                requests = [(s, prompt) for s in live for prompt in s.requests()]
                sampling_params = [s.sampling_params() for s, _ in requests]
                outputs = iter(self._run([p for _, p in requests], sampling_params, False))
                for search in live:
                    search.advance([next(outputs).outputs[0].logprobs[0] for _ in search.running])
                bar.update(sum(search.done for search in live))
        return [search.output(self.tokenizer) for search in searches]

    def _run(self, prompts, sampling_params, use_tqdm: bool, lora_request=None) -> list:
        """The outputs of ``prompts`` in order; ``sampling_params`` (one, or one per prompt)
        may be ``PoolingParams``: embeddings; ``lora_request`` one, or one per prompt."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, (SamplingParams, PoolingParams)):
            sampling_params = [sampling_params] * len(prompts)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        for name, values in (("sampling params", sampling_params), ("LoRA requests", lora_request)):
            if len(values) != len(prompts):
                raise ValueError(f"Got {len(values)} {name} for {len(prompts)} prompts.")
        # Every adapter checked before any request is added (LoRAAdapterError).
        for lora in dict.fromkeys(lora_request):  # in order, each once
            if lora is not None:
                self.input_processor.check_lora_request(lora)
        sampling_params = list(zip(sampling_params, lora_request, strict=True))
        # On any error, abort everything this call added: a bad prompt leaves nothing behind.
        added: list[str] = []
        try:
            request_ids, finished = self._run_engine(prompts, sampling_params, added, use_tqdm)
        except BaseException:
            self.engine_core.abort_requests(added)
            self.output_processor.abort_requests(added)
            raise
        outputs = {o.request_id: o for o in finished}
        return [outputs[r] for r in request_ids]

    def _add_request(
        self,
        prompt: ProcessedPrompt,
        params: tuple[SamplingParams | PoolingParams, LoRARequest | None],
        added: list[str],
    ) -> str:
        """Queue one prompt (``n`` engine requests) with its sampling params and adapter; their
        ids are appended to ``added``."""
        request_id = str(next(self._request_counter))
        sampling_params, lora_request = params
        _, requests = self.make_requests(
            request_id, prompt, sampling_params, stream=False, lora_request=lora_request
        )
        added.extend(request.request_id for request in requests)  # an abort ignores the others
        self.engine_core.add_requests(requests)
        return request_id

    def _submit(self, prompt: PromptType | ProcessedPrompt) -> PendingPrompt | Future:
        """Start processing a prompt; one processed already (a beam's) is ready as it is: a
        future holding it (done, as ``_run_engine`` asks of a ``PendingPrompt``)."""
        if not isinstance(prompt, ProcessedPrompt):
            return self.input_processor.process(prompt)
        done: Future = Future()
        done.set_result(prompt)
        return done

    def _run_engine(
        self,
        prompts: list[PromptType],
        sampling_params: Sequence[SamplingParams | PoolingParams],
        added: list[str],
        use_tqdm: bool,
    ) -> tuple[list[str], list[RequestOutput]]:
        """Submit the prompts to the input processor at most ``SUBMIT_WINDOW`` ahead of the
        engine (tokenize, hash and queue their images), add them in order as each one's
        images are ready, and step the engine whenever it has work; wait for the next prompt
        only when it has none. Ready prompts are added between submissions, so the first
        step starts once the first prompt is ready, not after the whole window was submitted,
        and the pool stays busy meanwhile. (A remote engine core's ``step()`` returns the
        outputs that arrived, its steps run on their own.)

        Returns the prompts' request ids and the finished outputs (in finishing order).
        """
        request_ids: list[str] = []
        finished: list[RequestOutput] = []
        submitted: collections.deque[PendingPrompt | Future] = collections.deque()
        engine = self.engine_core

        def add_ready() -> None:
            while submitted and (submitted[0].done() or not engine.has_unfinished_requests()):
                params = sampling_params[len(request_ids)]
                prompt = submitted.popleft().result()
                request_ids.append(self._add_request(prompt, params, added))

        with tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm) as bar:
            while len(request_ids) < len(prompts) or engine.has_unfinished_requests():
                queued = len(request_ids) + len(submitted)
                for prompt in prompts[queued : len(request_ids) + SUBMIT_WINDOW]:
                    submitted.append(self._submit(prompt))
                    add_ready()
                add_ready()
                if not engine.has_unfinished_requests():
                    continue
                done, to_abort = self.output_processor.process_outputs(engine.step())
                if to_abort:
                    engine.abort_requests(to_abort)
                finished.extend(done)
                bar.update(len(done))
        return request_ids, finished
