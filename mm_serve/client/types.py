"""Typed responses of the OpenAI-compatible API (pydantic models).

Unknown fields the server adds are kept (``extra="allow"``), so a newer server does not break
an older client; fields the server may omit default to None.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class Usage(_Model):
    """Token counts of one request (all choices together)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class TopLogprob(_Model):
    token: str
    logprob: float  # natural log
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    """One sampled token, its log-probability and the ``top_logprobs`` most likely tokens."""

    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(_Model):
    content: list[TokenLogprob] | None = None


class ChatMessage(_Model):
    role: str = "assistant"
    content: str | None = None


class _Choice(_Model):
    index: int = 0
    logprobs: Any = None
    finish_reason: str | None = None  # "stop", "length", ...


class _Response(_Model):
    """A response or chunk; subclasses narrow ``object`` and ``choices``."""

    id: str = ""
    object: str = ""
    created: int = 0  # Unix seconds
    model: str = ""
    choices: list = []
    usage: Usage | None = None


class Choice(_Choice):
    message: ChatMessage
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(_Response):
    """The answer of ``POST /v1/chat/completions`` without streaming."""

    object: str = "chat.completion"
    choices: list[Choice] = []


class Delta(_Model):
    role: str | None = None
    content: str | None = None


class ChunkChoice(_Choice):
    delta: Delta = Delta()
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Response):
    """One server-sent event of a streamed chat completion. With
    ``stream_options={"include_usage": True}`` the last chunk has no choices and a ``usage``."""

    object: str = "chat.completion.chunk"
    choices: list[ChunkChoice] = []


class CompletionLogprobs(_Model):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = []


class CompletionChoice(_Choice):
    text: str = ""
    logprobs: CompletionLogprobs | None = None


class Completion(_Response):
    """The answer of ``POST /v1/completions`` (also each streamed chunk of it)."""

    object: str = "text_completion"
    choices: list[CompletionChoice] = []


class Model(_Model):
    """One entry of ``GET /v1/models``."""

    id: str
    object: str = "model"
    created: int = 0
    owned_by: str | None = None
    max_model_len: int | None = None
