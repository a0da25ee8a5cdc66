"""The messages of a chat-completions request (pydantic): OpenAI's content parts (text,
``image_url``), vLLM's ``video_url`` part, and the message that holds them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from mm_serve.entrypoints.openai.protocol_tools import ToolCall


class _Part(BaseModel):
    # Undeclared keys are kept for ``request_fields.reject_undeclared_fields`` to refuse.
    model_config = ConfigDict(extra="allow")


class ImageURL(_Part):
    url: str  # data:image/...;base64,..., http(s)://... (allowed hosts), file://... (allowed root)
    # OpenAI's: "low" preprocesses the image with a smaller pixel budget (Qwen2-VL: at most
    # 448 x 448 pixels, 256 tokens; mm_processor.IMAGE_DETAILS); "high" and "auto" as the server.
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Part):
    type: Literal["text"]
    text: str


class ImageURLPart(_Part):
    type: Literal["image_url"]
    image_url: ImageURL
    # vLLM's extension: identifies the image in place of its content in the caches.
    uuid: str | None = None


class VideoURL(_Part):
    url: str  # data:video/...;base64,..., http(s)://... (allowed hosts), file://... (allowed root)


class VideoURLPart(_Part):
    """vLLM's video part: a video file (any container and codec FFmpeg decodes)."""

    type: Literal["video_url"]
    video_url: VideoURL
    uuid: str | None = None  # identifies the video in place of its content in the caches


ContentPart = Annotated[TextPart | ImageURLPart | VideoURLPart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    # Undeclared fields are kept for ``request_fields.reject_undeclared_fields`` to refuse.
    model_config = ConfigDict(extra="allow")

    role: str  # "system", "user", "assistant", "tool", ...: what the chat template accepts
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer: to which call
