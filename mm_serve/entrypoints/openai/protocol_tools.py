"""OpenAI's tool-calling shapes, for requests and responses (``tool_calls.py`` uses them)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, SerializerFunctionWrapHandler, model_serializer


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # the arguments always follow the schema exactly when enforced


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class OmitNone(BaseModel):
    """Serialised without its fields that are None (OpenAI's stream deltas)."""

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(OmitNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OmitNone):
    """A streamed call: its first delta has ``id``, ``type`` and the function's name, later
    ones add text to its ``arguments`` (clients concatenate them by ``index``)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall
