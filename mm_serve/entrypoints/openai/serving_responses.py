"""OpenAI's Responses API (``POST /v1/responses``, ``GET /v1/responses/{id}``) on top of chat.

A request becomes the chat it means (``instructions`` as a system message, the conversation of
``previous_response_id`` before ``input``, ``input_image`` parts as ``image_url`` parts,
``text.format`` as ``response_format``, ``max_output_tokens`` as ``max_tokens``) and runs
through ``ServingChat.start``, so a response answers as a chat completion of the same prompt
does. Its output is one assistant message of one ``output_text`` part; ``status`` is
``incomplete`` (``incomplete_details.reason: max_output_tokens``) when the length stopped it.

A stream sends OpenAI's events (``event:`` and ``data:`` lines, a ``sequence_number`` each):
``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, one ``response.output_text.delta`` per token, then
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``
and ``response.completed`` (or ``response.incomplete``) with the whole response.

``store`` (default true) keeps a response and its conversation in a bounded in-memory store
(``ResponseStore``, least recently used out) for ``previous_response_id`` and ``GET``;
``store: false`` keeps nothing.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from mm_serve.entrypoints.openai.errors import APIError, bad_request, user_errors
from mm_serve.entrypoints.openai.protocol import ChatCompletionRequest
from mm_serve.entrypoints.openai.protocol_responses import (
    NOT_IMPLEMENTED,
    InputMessage,
    ResponseObject,
    ResponsesRequest,
)
from mm_serve.entrypoints.openai.serving_chat import ServingChat
from mm_serve.entrypoints.openai.serving_common import (
    Admission,
    ModelInfo,
    ServingBase,
    collect,
    usage_info,
)
from mm_serve.frontend.async_llm import AsyncLLM
from mm_serve.messages.outputs import RequestOutput


class ResponseStore:
    """The last ``capacity`` stored responses: id -> (response object, its conversation as
    chat messages, the reply included)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._items[response["id"]] = (response, conversation)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> tuple[dict, list[dict]]:
        """The stored response and conversation.

        Raises:
            APIError: (404) no such response (never stored, or evicted).
        """
        if response_id not in self._items:
            raise APIError(404, f"No response with id {response_id!r}.", param=param)
        self._items.move_to_end(response_id)
        return self._items[response_id]


def chat_message(message: InputMessage, index: int) -> dict[str, Any]:
    """One input message as a chat message.

    Raises:
        APIError: (400) an ``input_image`` by ``file_id`` or without a URL.
    """
    if isinstance(message.content, str):
        return {"role": message.role, "content": message.content}
    parts = []
    for k, part in enumerate(message.content):
        if part.type != "input_image":
            parts.append({"type": "text", "text": part.text})
        elif part.image_url is None:
            param = f"input[{index}].content[{k}].{'file_id' if part.file_id else 'image_url'}"
            raise bad_request("input_image needs an image_url (files are not served).", param)
        else:
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
    return {"role": message.role, "content": parts}


def response_format(request: ResponsesRequest) -> dict | None:
    """``text.format`` as chat's ``response_format`` (None: plain text)."""
    fmt = request.text.format if request.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None or fmt.json_schema is None:
        raise bad_request("text.format json_schema needs a name and a schema.", "text.format")
    schema = {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": schema}


class ServingResponses(ServingBase):
    """``/v1/responses``: each request through ``chat`` (its admission, media and engine)."""

    def __init__(
        self, llm: AsyncLLM, model: ModelInfo, admission: Admission, chat: ServingChat
    ) -> None:
        super().__init__(llm, model, admission)
        self.chat = chat
        self.store = ResponseStore()

    async def create(self, request: ResponsesRequest, arrival_time: float) -> Any:
        for name in NOT_IMPLEMENTED:
            if getattr(request, name):
                raise bad_request(f"{name} is not supported by this server.", param=name)
        history = []
        if request.previous_response_id is not None:
            _, history = self.store.get(request.previous_response_id, "previous_response_id")
        conversation = [*history, *self._input(request)]
        system = (
            [{"role": "system", "content": request.instructions}] if request.instructions else []
        )
        chat_request = self._chat_request(request, [*system, *conversation])
        outputs, reply = await self.chat.start(chat_request, arrival_time)
        answer = _Answer(request, reply.model, conversation, self.store)
        if request.stream:
            return answer.stream(outputs)
        with user_errors():
            output = await collect(outputs)
        completion = output.outputs[0]
        return ResponseObject(**answer.finish(output, completion.text, len(completion.token_ids)))

    @staticmethod
    def _input(request: ResponsesRequest) -> list[dict]:
        if isinstance(request.input, str):
            return [{"role": "user", "content": request.input}]
        return [chat_message(message, i) for i, message in enumerate(request.input)]

    @staticmethod
    def _chat_request(request: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
        fields = {
            "model": request.model,
            "messages": messages,
            "max_tokens": request.max_output_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "response_format": response_format(request),
            "user": request.user,
        }
        body = json.dumps({k: v for k, v in fields.items() if v is not None})
        return ChatCompletionRequest.model_validate_json(body)


class _Answer:
    """One response being made: its ids, its object, the store."""

    def __init__(
        self, request: ResponsesRequest, model: str, conversation: list[dict], store
    ) -> None:
        self.request, self.model, self.conversation = request, model, conversation
        self.store = store if request.store else None
        self.id, self.item_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.sequence = itertools.count()

    def response(self, status: str, output: list[dict], usage: dict | None) -> dict:
        """The response object."""
        request = self.request
        fmt = {"type": "text"}
        if request.text and request.text.format:
            fmt = request.text.format.model_dump(by_alias=True, exclude_none=True)
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": False,
            "previous_response_id": request.previous_response_id,
            "store": request.store,
            "temperature": request.temperature,
            "text": {"format": fmt},
            "tool_choice": "none",
            "tools": [],
            "top_p": request.top_p,
            "truncation": "disabled",
            "usage": usage,
            "metadata": request.metadata or {},
        }

    def message(self, text: str, status: str) -> dict:
        """The output message of one ``output_text`` part."""
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": [part],
        }

    def finish(self, last: RequestOutput, text: str, num_tokens: int) -> dict:
        """The finished response (``last``: the final output or the stream's last delta);
        stored with its conversation unless ``store`` is false."""
        status = "incomplete" if last.outputs[0].finish_reason == "length" else "completed"
        usage = usage_info([last], num_tokens)
        response = self.response(
            status,
            [self.message(text, "completed")],
            {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {
                    "cached_tokens": usage.prompt_tokens_details.cached_tokens
                },
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.total_tokens,
            },
        )
        if self.store is not None:
            reply = {"role": "assistant", "content": text}
            self.store.put(response, [*self.conversation, reply])
        return response

    def event(self, kind: str, **fields: Any) -> str:
        """One server-sent event of the stream."""
        data = {"type": kind, "sequence_number": next(self.sequence), **fields}
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    async def stream(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        """The stream's events (module doc)."""
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        started = self.response("in_progress", [], None)
        yield self.event("response.created", response=started)
        yield self.event("response.in_progress", response=started)
        item = {**self.message("", "in_progress"), "content": []}
        yield self.event("response.output_item.added", output_index=0, item=item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        yield self.event("response.content_part.added", **where, part=part)
        text, num_tokens, last = "", 0, None
        async for last in outputs:
            delta = last.outputs[0]
            num_tokens += len(delta.token_ids)
            if delta.text:
                text += delta.text
                yield self.event(
                    "response.output_text.delta", **where, delta=delta.text, logprobs=[]
                )
        final = self.finish(last, text, num_tokens)
        yield self.event("response.output_text.done", **where, text=text, logprobs=[])
        yield self.event("response.content_part.done", **where, part={**part, "text": text})
        yield self.event("response.output_item.done", output_index=0, item=final["output"][0])
        done = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield self.event(done, response=final)
