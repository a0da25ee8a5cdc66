"""``POST /v1/embeddings`` (the pooling runner): each input, or the rendered chat messages with
their images, becomes one embedding request (``AsyncLLM.encode``)."""

from __future__ import annotations

import base64
import uuid

import numpy as np

from mm_serve.entrypoints.openai.errors import bad_request, engine_dead_error, user_errors
from mm_serve.entrypoints.openai.media import MediaResolver
from mm_serve.entrypoints.openai.protocol import UsageInfo
from mm_serve.entrypoints.openai.protocol_embeddings import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
)
from mm_serve.entrypoints.openai.serving_chat import check_chat_template_options
from mm_serve.entrypoints.openai.serving_common import (
    Admission,
    ModelInfo,
    check_request_fields,
    check_runner,
    gather_or_cancel,
    prompt_dicts,
)
from mm_serve.frontend.async_llm import AsyncLLM
from mm_serve.frontend.processor import ProcessedPrompt
from mm_serve.messages.pooling_params import PoolingParams


def encode_embedding(embedding: list[float], encoding_format: str) -> list[float] | str:
    """As the response carries it: the floats, or (``base64``) their float32 little-endian
    bytes in base64, which the OpenAI SDK decodes."""
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")


def pooling_params(request: EmbeddingRequest) -> PoolingParams:
    """``dimensions`` and ``normalize`` (or vLLM's newer ``use_activation``) of the request."""
    normalize = request.normalize if request.normalize is not None else request.use_activation
    return PoolingParams(dimensions=request.dimensions, normalize=normalize)


class ServingEmbedding:
    """Embeddings of texts, token ids or chat messages with images, under the admission limit
    (one sequence per request)."""

    def __init__(
        self, llm: AsyncLLM, model: ModelInfo, admission: Admission, media: MediaResolver
    ) -> None:
        self.llm, self.model, self.admission, self.media = llm, model, admission, media

    async def handle(self, request: EmbeddingRequest, arrival_time: float) -> EmbeddingResponse:
        """The response; raises APIError (see ``errors``): a 400 naming ``model`` when the
        server does not run the pooling runner, ``input``/``messages`` when neither or both
        are given or an input is empty, ``dimensions`` the model does not allow."""
        if self.llm.is_dead:
            raise engine_dead_error()
        check_request_fields(request)
        check_runner(self.llm, pooling=True)
        self.admission.enter()
        try:
            return await self.create(request, arrival_time)
        finally:
            self.admission.leave()

    async def create(self, request: EmbeddingRequest, arrival_time: float) -> EmbeddingResponse:
        model = self.model.name_for(request.model)
        if self.model.lora_request(model) is not None:
            raise bad_request("LoRA adapters are not served for embeddings.", param="model")
        params = pooling_params(request)
        prompts = await self._prompts(request)
        request_id = f"embd-{uuid.uuid4().hex}"
        encode = self.llm.encode
        with user_errors():
            outputs = await gather_or_cancel(
                encode(p, params, f"{request_id}-{i}", arrival_time, request.priority)
                for i, p in enumerate(prompts)
            )
        data = [
            EmbeddingResponseData(
                index=i, embedding=encode_embedding(o.outputs.embedding, request.encoding_format)
            )
            for i, o in enumerate(outputs)
        ]
        num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        usage = UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens)
        return EmbeddingResponse(id=request_id, model=model, data=data, usage=usage)

    async def _prompts(self, request: EmbeddingRequest) -> list[ProcessedPrompt]:
        """The processed prompts: one per ``input``, or the one of ``messages``."""
        if (request.input is None) == (request.messages is None):
            raise bad_request("Give exactly one of input and messages.", param="input")
        if request.messages is not None:
            return [await self._chat_prompt(request)]
        prompts = prompt_dicts(request.input, "input", self.llm.config.model.vocab_size)
        if any(not next(iter(p.values())) for p in prompts):
            raise bad_request("input must not contain an empty text or list.", param="input")
        add_special_tokens = request.add_special_tokens is not False
        with user_errors():
            return [await self.llm.process(p, add_special_tokens) for p in prompts]

    async def _chat_prompt(self, request: EmbeddingRequest) -> ProcessedPrompt:
        """``messages`` rendered by the chat template (vLLM's defaults: no generation prompt,
        no special tokens beyond the template's), their images resolved."""
        check_chat_template_options(
            request.messages, request.add_generation_prompt, request.continue_final_message
        )
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        messages = await self.media.resolve(messages)
        with user_errors():
            return await self.llm.process_chat(
                messages,
                mm_processor_kwargs=request.mm_processor_kwargs,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template_kwargs=request.chat_template_kwargs,
                add_special_tokens=bool(request.add_special_tokens),
            )
