"""The offline API in vLLM's shape: ``LLM(model=...).generate(...)`` and ``.chat(...)``."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from mm_serve.config import EngineArgs
from mm_serve.engine.core import EngineCore
from mm_serve.engine.output_processor import OutputProcessor, ParentRequest
from mm_serve.engine.processor import (
    InputProcessor,
    ProcessedPrompt,
    PromptType,
    load_generation_config,
    load_tokenizer,
)
from mm_serve.outputs import RequestOutput
from mm_serve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_DEFAULTS_FROM_GENERATION_CONFIG = ("temperature", "top_p", "top_k", "repetition_penalty")


class LLM:
    """An engine core run in-process over a batch of prompts.

    Args:
        model: a checkpoint folder or a Hugging Face hub id.
        **engine_args: any ``EngineArgs`` field (``max_num_batched_tokens``, ``num_kv_blocks``,
            ``enable_prefix_caching``, ``dtype``, ``seed``, ...).

    Raises:
        ValueError: on an unusable checkpoint or option (see ``EngineArgs``).
    """

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.config = EngineArgs(model=model, **engine_args).create_engine_config()
        self.tokenizer = load_tokenizer(self.config.model.tokenizer)
        self.generation_config = load_generation_config(self.config.model.path)
        self.input_processor = InputProcessor(
            self.config.model, self.config.multimodal, self.tokenizer, self.generation_config
        )
        self.engine_core = EngineCore(self.config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults, overridden by the checkpoint's ``generation_config.json``."""
        overrides = {}
        for name in _DEFAULTS_FROM_GENERATION_CONFIG:
            value = getattr(self.generation_config, name, None)
            if value is not None:
                overrides[name] = value
        return SamplingParams(**overrides)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for each prompt; outputs come back in the prompts' order.

        Raises:
            ValueError: on a bad prompt (too long, empty, images for a text model) or a list of
                sampling params whose length differs from the prompts'. No request of the
                call is started then.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations (OpenAI messages)."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            self.input_processor.apply_chat_template(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
            for conversation in conversations
        ]
        return self._run(prompts, sampling_params, use_tqdm)

    def _run(self, prompts, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"Got {len(sampling_params)} sampling params for {len(prompts)} prompts."
            )
        # Validate everything first, and roll back on a late error: a bad prompt starts nothing.
        processed = [self.input_processor.process(p) for p in prompts]
        request_ids: list[str] = []
        added: list[str] = []
        try:
            for prompt, params in zip(processed, sampling_params, strict=True):
                request_ids.append(self._add_request(prompt, params, added))
        except ValueError:
            self.engine_core.abort_requests(added)
            self.output_processor.abort_requests(added)
            raise
        outputs = {o.request_id: o for o in self._run_engine(len(request_ids), use_tqdm)}
        return [outputs[r] for r in request_ids]

    def _add_request(
        self, prompt: ProcessedPrompt, params: SamplingParams, added: list[str]
    ) -> str:
        """Queue one prompt (``n`` engine requests); their ids are appended to ``added``."""
        request_id = str(next(self._request_counter))
        parent = ParentRequest(request_id, prompt.text, prompt.token_ids, num_children=params.n)
        requests = self.input_processor.make_requests(request_id, prompt, params)
        for index, request in enumerate(requests):
            self.engine_core.add_request(request)
            added.append(request.request_id)
            self.output_processor.add_request(
                request.request_id, parent, index, request.sampling_params
            )
        return request_id

    def _run_engine(self, num_requests: int, use_tqdm: bool) -> list[RequestOutput]:
        finished: list[RequestOutput] = []
        with tqdm(total=num_requests, desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.engine_core.has_unfinished_requests():
                outputs = self.engine_core.step()
                done, to_abort = self.output_processor.process_outputs(outputs)
                if to_abort:
                    self.engine_core.abort_requests(to_abort)
                finished.extend(done)
                bar.update(len(done))
        return finished
