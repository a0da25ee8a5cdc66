"""The request of OpenAI's Responses API (``POST /v1/responses``) for text and image input.

``input`` is a string or a list of messages (``role`` and a string or ``input_text`` /
``input_image`` / ``output_text`` parts). Fields OpenAI defines for what this server does not
do (tools, reasoning, background runs, stored prompts, conversations, ...) are declared here
so that a request setting one is a 400 naming it (``NOT_IMPLEMENTED``); a field OpenAI does
not define is accepted and logged once, as for chat.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mm_serve.entrypoints.openai.protocol import JSONSchemaFormat, _Request


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow")


class InputText(_Part):
    type: Literal["input_text"]
    text: str


class InputImage(_Part):
    type: Literal["input_image"]
    image_url: str | None = None  # an http(s) or data: URL
    file_id: str | None = None  # OpenAI's uploaded files: not served
    detail: Literal["auto", "low", "high"] = "auto"


class OutputText(_Part):
    """An earlier assistant turn's text, as the SDK sends a reply back."""

    type: Literal["output_text"]
    text: str


ContentPart = Annotated[InputText | InputImage | OutputText, Field(discriminator="type")]


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class TextFormat(JSONSchemaFormat):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name`` and ``schema``
    at this level, unlike chat's ``response_format``)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # type: ignore[assignment]


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: TextFormat | None = None


# Fields of OpenAI's request this server does not implement: set (not null, false or empty),
# each is a 400 naming it.
NOT_IMPLEMENTED = (
    "background",
    "conversation",
    "include",
    "max_tool_calls",
    "prompt",
    "reasoning",
    "tools",
    "top_logprobs",
)


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None
    tool_choice: Literal["none", "auto"] | None = None  # without tools, both mean no call
    truncation: Literal["disabled"] | None = None
    # NOT_IMPLEMENTED:
    background: bool | None = None
    conversation: Any = None
    include: list[str] | None = None
    max_tool_calls: int | None = None
    prompt: Any = None
    reasoning: Any = None
    tools: list[Any] | None = None
    top_logprobs: int | None = None

    @property
    def n(self) -> int:
        """One output per response (what admission counts)."""
        return 1


class ResponseObject(BaseModel):
    """A response object as built (``serving_responses``), returned as it is."""

    model_config = ConfigDict(extra="allow")
