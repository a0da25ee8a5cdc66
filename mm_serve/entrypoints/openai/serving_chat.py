"""``POST /v1/chat/completions``: messages with text and images in, a reply (or SSE chunks)
out."""

from __future__ import annotations

import contextlib
import dataclasses
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
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
)
from mm_serve.entrypoints.openai.serving_common import (
    Admission,
    ModelInfo,
    Reply,
    ServingBase,
    StreamUsage,
    collect,
    per_token,
    stream_usage,
    usage_info,
)
from mm_serve.entrypoints.openai.tool_calls import ToolCallStream, ToolMode, template_messages
from mm_serve.frontend.async_llm import AsyncLLM
from mm_serve.messages.outputs import CompletionOutput, RequestOutput


@dataclasses.dataclass
class _Reply(Reply):
    _: dataclasses.KW_ONLY
    role: str = "assistant"  # the reply's role
    echo: str = ""  # what each choice's content starts with
    tools: ToolMode = ToolMode("none")

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
        usage = stream_usage(request)
        outputs, reply = await self.start(request, arrival_time)
        if request.stream:
            return _stream(outputs, reply, usage)
        with user_errors():
            return _response(await collect(outputs), reply)

    async def start(
        self, request: ChatCompletionRequest, arrival_time: float
    ) -> tuple[AsyncIterator[RequestOutput], _Reply]:
        """Check the request, render and process the chat, and start generating: the outputs
        (each a delta) and the settings of the reply (``create``'s, the Responses API's).

        Raises:
            APIError: the request's error (see ``errors``).
        """
        model = self.model.name_for(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true.", param="top_logprobs")
        num_top = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = request.max_completion_tokens
        max_tokens = request.max_tokens if max_tokens is None else max_tokens
        tools = ToolMode.of(request)
        params = self.sampling_params(request, max_tokens, num_top, tools.constraint(request))
        check_chat_template_options(
            request.messages, request.add_generation_prompt, request.continue_final_message
        )
        if request.cache_salt is not None and not request.cache_salt:
            raise bad_request("cache_salt must not be empty.", param="cache_salt")
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        messages = template_messages(await self.media.resolve(messages))
        template_tools = [t.model_dump(exclude_none=True) for t in request.tools or ()] or None
        with user_errors():
            processed = await self.llm.process_chat(
                messages,
                request.cache_salt,
                request.mm_processor_kwargs,
                tools=template_tools,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template_kwargs=request.chat_template_kwargs,
                add_special_tokens=request.add_special_tokens,
            )
        params = self.fit_to_context(params, processed)
        # vLLM's: the reply is the assistant's unless no generation prompt opened its turn.
        role = "assistant" if request.add_generation_prompt else request.messages[-1].role
        reply = _Reply(
            f"chatcmpl-{uuid.uuid4().hex}",
            model,
            num_top,
            request.return_tokens_as_token_ids,
            return_token_ids=request.return_token_ids,
            role=role,
            echo=_echo(request.messages[-1], role) if request.echo else "",
            tools=tools,
        )
        return self.generate(request, processed, params, reply.request_id, arrival_time), reply


def check_chat_template_options(
    messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool
) -> None:
    """vLLM's rules for rendering a chat: messages, and ``continue_final_message`` only with
    ``add_generation_prompt`` false and an assistant's last message (the turn to continue).

    Raises:
        APIError: (400) naming ``messages`` or ``continue_final_message``.
    """
    if not messages:
        raise bad_request("messages must not be empty.", param="messages")
    if not continue_final_message:
        return
    if add_generation_prompt:
        raise bad_request(
            "continue_final_message needs add_generation_prompt to be false.",
            param="continue_final_message",
        )
    if messages[-1].role != "assistant":
        raise bad_request(
            "continue_final_message needs the last message to be the assistant's, not the "
            f"{messages[-1].role!r}'s.",
            param="continue_final_message",
        )


def _echo(last: ChatMessage, role: str) -> str:
    """What ``echo`` prefixes each choice's content with: the last message's text (its text
    parts joined by newlines) when that message has the reply's role, else nothing (vLLM's)."""
    if last.role != role or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part.text for part in last.content if part.type == "text")


def _response(output: RequestOutput, reply: _Reply) -> ChatCompletionResponse:
    choices = []
    for c in output.outputs:
        content, tool_calls = reply.tools.calls(c.text)
        content = reply.echo + content if content is not None else (reply.echo or None)
        message = ChatResponseMessage(
            role=reply.role, content=content, tool_calls=tool_calls or None
        )
        choice = ChatCompletionChoice(
            index=c.index,
            message=message,
            logprobs=reply.logprobs(c),
            finish_reason=reply.tools.finish_reason(c.finish_reason, tool_calls),
            stop_reason=c.stop_reason,
            token_ids=reply.token_ids(c.token_ids),
        )
        choices.append(choice)
    return reply.response(
        ChatCompletionResponse,
        choices,
        usage_info([output], sum(len(c.token_ids) for c in output.outputs)),
        prompt_token_ids=reply.token_ids(output.prompt_token_ids),
        prompt_logprobs=prompt_logprobs_field(output.prompt_logprobs),
    )


async def _stream(
    outputs: AsyncIterator[RequestOutput], reply: _Reply, usage: StreamUsage
) -> AsyncIterator[str]:
    """One chunk per choice and token, as OpenAI streams: a choice's first chunk is its role
    alone (``{"role": "assistant", "content": ""}``), then with ``echo`` one chunk of the echoed
    text, then each token's chunk has ``content``
    (empty for a token without text of its own) and no role; the last token's chunk has the
    finish reason. ``usage``: a last chunk of the usage, and the usage so far in each."""
    started: set[int] = set()
    tool_streams: dict[int, ToolCallStream] = {}
    num_completion = 0
    last = None
    async with contextlib.aclosing(outputs):
        async for last in outputs:
            for delta in last.outputs:
                if delta.index not in started:
                    prompt_token_ids = None if started else reply.token_ids(last.prompt_token_ids)
                    started.add(delta.index)
                    role = DeltaMessage(role=reply.role, content="")
                    choice = ChatCompletionStreamChoice(index=delta.index, delta=role)
                    yield reply.event(
                        ChatCompletionChunk,
                        [choice],
                        usage.so_far([last], num_completion),
                        prompt_token_ids=prompt_token_ids,
                    )
                    if reply.echo:
                        choice = ChatCompletionStreamChoice(
                            index=delta.index, delta=DeltaMessage(content=reply.echo)
                        )
                        yield reply.event(
                            ChatCompletionChunk, [choice], usage.so_far([last], num_completion)
                        )
                for piece in per_token(delta):
                    num_completion += len(piece.token_ids)
                    if reply.tools.choice == "none":
                        choices = [_stream_choice(piece, reply)]
                    else:
                        stream = tool_streams.setdefault(delta.index, ToolCallStream(reply.tools))
                        choices = _tool_stream_choices(piece, stream, reply)
                    for choice in choices:
                        so_far = usage.so_far([last], num_completion)
                        yield reply.event(ChatCompletionChunk, [choice], so_far)
    if usage.final and last is not None:
        yield reply.event(ChatCompletionChunk, [], usage_info([last], num_completion))


def _tool_stream_choices(
    piece: CompletionOutput, stream: ToolCallStream, reply: _Reply
) -> list[ChatCompletionStreamChoice]:
    """A token's chunks when the reply may hold tool calls (``ToolCallStream``); the last of a
    finished choice has its finish reason."""
    finished = piece.finish_reason is not None
    deltas = stream.deltas(piece.text, finished)
    if finished and not deltas:
        deltas = [DeltaMessage()]
    choices = [ChatCompletionStreamChoice(index=piece.index, delta=d) for d in deltas]
    if finished:
        choices[-1].finish_reason = reply.tools.finish_reason(piece.finish_reason, stream.calls)
        choices[-1].stop_reason = piece.stop_reason
    return choices


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
