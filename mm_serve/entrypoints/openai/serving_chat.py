"""``POST /v1/chat/completions``: messages with text and images in, a reply (or SSE chunks)
out."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

from mm_serve.entrypoints.openai.errors import bad_request, user_errors
from mm_serve.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_field
from mm_serve.entrypoints.openai.media import MediaResolver
from mm_serve.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatLogprobs,
    ChatResponseMessage,
    DeltaMessage,
)
from mm_serve.entrypoints.openai.serving_common import (
    Admission,
    ModelInfo,
    Reply,
    ServingBase,
    collect,
    per_token,
    sse_event,
    stream_usage,
    stream_with_errors,
    usage_info,
)
from mm_serve.frontend.async_llm import AsyncLLM
from mm_serve.outputs import CompletionOutput, RequestOutput


class _Reply(Reply):
    def logprobs(self, output: CompletionOutput) -> ChatLogprobs | None:
        if self.num_top_logprobs is None:
            return None
        content = chat_logprobs(
            output.token_ids, output.logprobs, self.num_top_logprobs, self.tokens_as_ids
        )
        return ChatLogprobs(content=content)


class ServingChat(ServingBase):
    """Chat completions: images resolved (``MediaResolver``), the chat template applied and
    the prompt processed off the event loop, then generated (``AsyncLLM``)."""

    def __init__(
        self, llm: AsyncLLM, model: ModelInfo, admission: Admission, media: MediaResolver
    ) -> None:
        super().__init__(llm, model, admission)
        self.media = media

    async def create(
        self, request: ChatCompletionRequest, arrival_time: float
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        model = self.model.name_for(request.model)
        include_usage = stream_usage(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true.", param="top_logprobs")
        num_top = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = request.max_completion_tokens
        max_tokens = request.max_tokens if max_tokens is None else max_tokens
        params = self.sampling_params(request, max_tokens, num_top)
        if not request.messages:
            raise bad_request("messages must not be empty.", param="messages")
        if request.cache_salt is not None and not request.cache_salt:
            raise bad_request("cache_salt must not be empty.", param="cache_salt")
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        messages = await self.media.resolve(messages)
        with user_errors():
            processed = await self.llm.process_chat(messages, request.cache_salt)
        params = self.fit_to_context(params, processed)
        reply = _Reply(
            f"chatcmpl-{uuid.uuid4().hex}",
            model,
            num_top,
            request.return_tokens_as_token_ids,
            return_token_ids=request.return_token_ids,
        )
        outputs = self.generate(request, processed, params, reply.request_id, arrival_time)
        if request.stream:
            return stream_with_errors(_stream(outputs, reply, include_usage))
        with user_errors():
            return _response(await collect(outputs), reply)


def _response(output: RequestOutput, reply: _Reply) -> ChatCompletionResponse:
    choices = [
        ChatCompletionChoice(
            index=c.index,
            message=ChatResponseMessage(content=c.text),
            logprobs=reply.logprobs(c),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            token_ids=reply.token_ids(c.token_ids),
        )
        for c in output.outputs
    ]
    num_completion = sum(len(c.token_ids) for c in output.outputs)
    usage = usage_info(
        len(output.prompt_token_ids),
        num_completion,
        output.num_cached_tokens,
        output.num_cached_images,
    )
    return reply.response(
        ChatCompletionResponse,
        choices,
        usage,
        prompt_token_ids=reply.token_ids(output.prompt_token_ids),
        prompt_logprobs=prompt_logprobs_field(output.prompt_logprobs),
    )


async def _stream(
    outputs: AsyncIterator[RequestOutput], reply: _Reply, include_usage: bool
) -> AsyncIterator[str]:
    """One chunk per choice and token, as OpenAI streams: a choice's first chunk is its role
    alone (``{"role": "assistant", "content": ""}``), then each token's chunk has ``content``
    (empty for a token without text of its own) and no role; the last token's chunk has the
    finish reason."""
    started: set[int] = set()
    num_completion = 0
    last = None
    async with contextlib.aclosing(outputs):
        async for last in outputs:
            for delta in last.outputs:
                if delta.index not in started:
                    prompt_token_ids = None if started else reply.token_ids(last.prompt_token_ids)
                    started.add(delta.index)
                    role = DeltaMessage(role="assistant", content="")
                    choice = ChatCompletionStreamChoice(index=delta.index, delta=role)
                    chunk = reply.response(
                        ChatCompletionChunk, [choice], prompt_token_ids=prompt_token_ids
                    )
                    yield sse_event(chunk)
                for piece in per_token(delta):
                    choice = _stream_choice(piece, reply)
                    yield sse_event(reply.response(ChatCompletionChunk, [choice]))
                num_completion += len(delta.token_ids)
    if include_usage and last is not None:
        usage = usage_info(
            len(last.prompt_token_ids),
            num_completion,
            last.num_cached_tokens,
            last.num_cached_images,
        )
        yield sse_event(reply.response(ChatCompletionChunk, [], usage))


def _stream_choice(piece: CompletionOutput, reply: _Reply) -> ChatCompletionStreamChoice:
    # A finish without a token of its own carries no content: clients would count a token.
    has_content = bool(piece.token_ids or piece.text)
    return ChatCompletionStreamChoice(
        index=piece.index,
        delta=DeltaMessage(content=piece.text) if has_content else DeltaMessage(),
        logprobs=reply.logprobs(piece),
        finish_reason=piece.finish_reason,
        stop_reason=piece.stop_reason,
        token_ids=reply.token_ids(piece.token_ids),
    )
