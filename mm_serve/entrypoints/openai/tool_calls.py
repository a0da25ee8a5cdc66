"""OpenAI's tool calling on chat completions: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

- ``"none"``: text. ``"auto"`` (the default with tools): a ``ToolParser`` finds the calls the
  chat template taught (``hermes``: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``).
- ``"required"`` and a named function are enforced with structured outputs (vLLM's method): a
  JSON array of ``{"name", "parameters"}`` calls (at least one; one unless
  ``parallel_tool_calls``), or the named function's arguments, valid for its schema.

The reply carries ``tool_calls`` (content None) and, unless a function was named,
``finish_reason: "tool_calls"`` (vLLM's; OpenAI ends a named function's answer in "stop")."""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from mm_serve.entrypoints.openai.errors import bad_request
from mm_serve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from mm_serve.messages.structured_outputs import StructuredOutputsParams


class ToolParser(Protocol):
    """Finds the tool calls a model wrote in its reply's text."""

    start_marker: str  # text that opens the first call: a stream holds back from there

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        """``(content before the calls or None, the calls)``; no calls: ``(text, [])``."""
        ...


class HermesToolParser:
    """Hermes-style calls (Qwen2/2.5-VL's templates): ``<tool_call>\\n{"name": ...,
    "arguments": {...}}\\n</tool_call>``, one block per call. A block that is not such JSON
    stays in the content."""

    start_marker = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        calls = []
        for block in self._BLOCK.findall(text):
            try:
                call = json.loads(block)
                name, arguments = call["name"], call.get("arguments", {})
            except (json.JSONDecodeError, KeyError, TypeError):
                return text, []
            if not isinstance(name, str):
                return text, []
            calls.append(FunctionCall(name=name, arguments=json.dumps(arguments)))
        if not calls:
            return text, []
        content = text[: text.index(self.start_marker)].strip()
        return content or None, calls


# The parsers of calls written as text, by the name vLLM's --tool-call-parser gives them (one
# so far: the Qwen-VL templates' format).
TOOL_PARSERS: dict[str, type] = {"hermes": HermesToolParser}


@dataclass(frozen=True)
class ToolMode:
    """How a request's reply holds tool calls: ``choice`` is "none", "auto", "required" or
    "named" (then ``function``, the named function's name)."""

    choice: str
    function: str | None = None
    parser: ToolParser | None = None

    @classmethod
    def of(cls, request: ChatCompletionRequest) -> ToolMode:
        """Raises APIError (400) for a ``tool_choice`` without ``tools``, or naming a
        function that is not among them."""
        choice = request.tool_choice
        if not request.tools:
            if choice not in (None, "none"):
                raise bad_request("tool_choice needs tools.", param="tool_choice")
            return cls("none")
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            if name not in {tool.function.name for tool in request.tools}:
                raise bad_request(f"tool_choice names no tool {name!r}.", param="tool_choice")
            return cls("named", name)
        if choice == "none":
            return cls("none")
        return cls(choice or "auto", parser=TOOL_PARSERS["hermes"]())

    def constraint(self, request: ChatCompletionRequest) -> StructuredOutputsParams | None:
        """The structured output that enforces ``required`` or a named function."""
        schemas = {t.function.name: t.function.parameters or {"type": "object"}
                   for t in request.tools or ()}  # fmt: skip
        if self.choice == "named":
            return StructuredOutputsParams(json=json.dumps(schemas[self.function]))
        if self.choice != "required":
            return None
        call = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for name, schema in schemas.items()]  # fmt: skip
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": call}, "minItems": 1}
        if request.parallel_tool_calls is False:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=json.dumps(array))

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The reply's content and tool calls, from its whole text."""
        if self.choice == "named":
            return None, [_tool_call(FunctionCall(name=self.function, arguments=text))]
        if self.choice == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:  # cut by max_tokens
                return text, []
            calls = [FunctionCall(name=i["name"], arguments=json.dumps(i["parameters"]))
                     for i in items]  # fmt: skip
            return None, [_tool_call(call) for call in calls]
        if self.choice == "auto":
            content, calls = self.parser.extract(text)
            return content, [_tool_call(call) for call in calls]
        return text, []

    def finish_reason(self, reason: str | None, tool_calls: list[ToolCall]) -> str | None:
        if tool_calls and self.choice != "named" and reason == "stop":
            return "tool_calls"
        return reason


def _tool_call(function: FunctionCall) -> ToolCall:
    return ToolCall(id=f"chatcmpl-tool-{uuid.uuid4().hex}", function=function)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for the chat template: an assistant's ``tool_calls`` arguments as objects
    (HF templates render them with ``tojson``), not OpenAI's JSON strings."""
    for message in messages:
        for call in message.get("tool_calls") or ():
            with contextlib.suppress(json.JSONDecodeError, TypeError):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return messages


class ToolCallStream:
    """One choice's stream with tools, as OpenAI streams calls: a call's first delta has its
    ``id``, ``type`` and name, then its ``arguments`` follow. A named function's arguments
    stream as they are generated; ``required`` and ``auto`` calls are known once the text is
    complete and come with the finish, ``auto`` content streaming before them up to the
    parser's start marker."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.text = ""
        self.num_sent = 0  # characters of content streamed
        self.calls: list[ToolCall] = []

    def deltas(self, text: str, finished: bool) -> list[DeltaMessage]:
        """The deltas for ``text``, the choice's next piece (``finished``: its last)."""
        self.text += text
        if self.mode.choice == "named":
            call = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))
            if not self.calls:  # the call's first delta: its id and name
                self.calls = [_tool_call(FunctionCall(name=self.mode.function, arguments=""))]
                call.id, call.type = self.calls[0].id, "function"
                call.function.name = self.mode.function
            elif not text:
                return []
            return [DeltaMessage(tool_calls=[call])]
        if not finished:
            return self._content(self._safe_end()) if self.mode.choice == "auto" else []
        content, self.calls = self.mode.calls(self.text)
        end = self.text.index(self.mode.parser.start_marker) if content and self.calls else None
        deltas = self._content(len(self.text) if not self.calls else end or self.num_sent)
        calls = [DeltaToolCall(index=i, id=call.id, type="function",
                               function=DeltaFunctionCall(name=call.function.name,
                                                          arguments=call.function.arguments))
                 for i, call in enumerate(self.calls)]  # fmt: skip
        return deltas + ([DeltaMessage(tool_calls=calls)] if calls else [])

    def _content(self, end: int) -> list[DeltaMessage]:
        piece, self.num_sent = self.text[self.num_sent : end], max(end, self.num_sent)
        return [DeltaMessage(content=piece)] if piece else []

    def _safe_end(self) -> int:
        """Where streamed content must stop: before the start marker, or before a tail of
        the text that may be its beginning."""
        marker = self.mode.parser.start_marker
        if marker in self.text:
            return self.text.index(marker)
        for size in range(min(len(marker) - 1, len(self.text)), 0, -1):
            if marker.startswith(self.text[-size:]):
                return len(self.text) - size
        return len(self.text)
