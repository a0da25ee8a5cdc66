"""What the offline ``LLM`` and the server's ``AsyncLLM`` share: the config, resolved once, the
tokenizer, the input processor with its preprocessing pool, and the output processor."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING, Any

from mm_serve.checkpoint.hub import load_generation_config
from mm_serve.config import EngineArgs
from mm_serve.frontend.output_processor import OutputProcessor, ParentRequest
from mm_serve.frontend.processor import InputProcessor, ProcessedPrompt, load_tokenizer
from mm_serve.lora.request import LoRARequest
from mm_serve.messages.pooling_params import PoolingParams
from mm_serve.messages.request import Request
from mm_serve.messages.sampling_params import SamplingParams
from mm_serve.messages.stats import EngineStats

if TYPE_CHECKING:
    from mm_serve.frontend.core_client import EngineCoreClientBase

logger = logging.getLogger(__name__)

# SamplingParams fields whose default the checkpoint's generation_config.json may set (vLLM's).
DEFAULTS_FROM_GENERATION_CONFIG = ("temperature", "top_p", "top_k", "repetition_penalty")


class FrontEnd:
    """The front end of one engine; ``LLM`` and ``AsyncLLM`` add the engine core.

    Builds, in order: the ``EngineConfig`` (``EngineArgs.create_engine_config``; the engine
    core gets this one, it does not resolve its own), the tokenizer, the checkpoint's
    ``generation_config.json``, the ``InputProcessor`` (for a VLM, with its preprocessing pool,
    not started yet) and the ``OutputProcessor``. Call ``input_processor.shutdown()`` when done.
    ``engine_process``: an engine core client started first, so that its process imports the
    engine meanwhile (``start(config)`` is the caller's); shut down if this set-up fails.

    Raises:
        ValueError: an unusable checkpoint or option.
    """

    def __init__(
        self, engine_args: EngineArgs, engine_process: EngineCoreClientBase | None = None
    ) -> None:
        try:
            start = time.perf_counter()
            self.config = engine_args.create_engine_config()
            logger.info("Resolved the engine config in %.1f s", time.perf_counter() - start)
            self.tokenizer = load_tokenizer(self.config.model.tokenizer)
            self.generation_config = load_generation_config(self.config.model.path)
            self.input_processor = InputProcessor(
                self.config.model,
                self.config.multimodal,
                self.tokenizer,
                self.generation_config,
                self.config.lora,
            )
        except BaseException:
            if engine_process is not None:
                engine_process.shutdown()
            raise
        self.output_processor = OutputProcessor(self.tokenizer)

    def get_tokenizer(self):
        return self.tokenizer

    def default_sampling_overrides(self) -> dict[str, Any]:
        """Sampling defaults from the checkpoint's ``generation_config.json`` (may be empty)."""
        names, config = DEFAULTS_FROM_GENERATION_CONFIG, self.generation_config
        return {n: v for n in names if (v := getattr(config, n, None)) is not None}

    def start_preprocessing(self) -> list[concurrent.futures.Future[int]]:
        """Start the preprocessing workers (they warm up while the engine core loads); one
        future per worker, done when it is ready. None for a text-only model."""
        mm_processor = self.input_processor.mm_processor
        return mm_processor.pool.start() if mm_processor is not None else []

    def add_front_end_stats(self, stats: EngineStats) -> EngineStats:
        """``stats`` (the engine core's counters) with the processor cache's, which are ours."""
        mm_processor = self.input_processor.mm_processor
        if mm_processor is not None:
            stats.processor_cache_queries = mm_processor.cache.queries
            stats.processor_cache_hits = mm_processor.cache.hits
        return stats

    def check_runner(self, pooling: bool) -> None:
        """Raises ValueError unless the engine runs the kind of request asked for: pooling
        (embeddings) under ``runner="pooling"``, generation otherwise."""
        runner = self.config.model.runner
        if pooling and runner != "pooling":
            raise ValueError(
                "This model generates; start it with runner='pooling' (--runner pooling) to "
                "serve embeddings."
            )
        if not pooling and runner == "pooling":
            raise ValueError(
                "This model serves embeddings (runner='pooling'); it does not generate."
            )

    def make_requests(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams | PoolingParams,
        stream: bool,
        lora_request: LoRARequest | None = None,
    ) -> tuple[ParentRequest, list[Request]]:
        """The engine requests of one user request (``n`` of them, with the adapter
        ``lora_request``; one embedding request for ``PoolingParams``), tracked by the output
        processor as the children of the returned parent (see ``InputProcessor.make_requests``,
        ``make_pooling_request``).

        Raises:
            ValueError: an engine request id is already tracked (in flight), the request is not
                of the engine's runner (``check_runner``), an adapter with an embedding
                request; a ``LoRAAdapterError`` for an adapter that cannot be served.
        """
        pooling = isinstance(params, PoolingParams)
        self.check_runner(pooling)
        if pooling and lora_request is not None:
            raise ValueError("LoRA adapters are not served for embeddings.")
        if pooling:
            requests = [self.input_processor.make_pooling_request(request_id, prompt, params)]
        else:
            requests = self.input_processor.make_requests(request_id, prompt, params, lora_request)
        in_flight = [r.request_id for r in requests if r.request_id in self.output_processor.states]
        if in_flight:
            raise ValueError(f"Request id {in_flight[0]!r} is already in flight.")
        parent = ParentRequest(
            request_id, prompt.text, prompt.token_ids, len(requests), stream, pooling=pooling
        )
        for index, request in enumerate(requests):
            self.output_processor.add_request(
                request.request_id, parent, index, request.sampling_params
            )
        return parent, requests
