"""Typed responses of the OpenAI-compatible API (pydantic models).

Unknown fields the server adds are kept (``extra="allow"``), so a newer server does not break
an older client; fields the server may omit default to None.
"""

from __future__ import annotations

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


class TokenLogprob(_Model):
    """One sampled token, its log-probability and the ``top_logprobs`` most likely tokens."""

    token: str
    logprob: float  # natural log
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(_Model):
    content: list[TokenLogprob] | None = None


class ChatMessage(_Model):
    role: str = "assistant"
    content: str | None = None


class Choice(_Model):
    index: int = 0
    message: ChatMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length", ...


class ChatCompletion(_Model):
    """The answer of ``POST /v1/chat/completions`` without streaming."""

    id: str = ""
    object: str = "chat.completion"
    created: int = 0  # Unix seconds
    model: str = ""
    choices: list[Choice] = []
    usage: Usage | None = None


class Delta(_Model):
    role: str | None = None
    content: str | None = None


class ChunkChoice(_Model):
    index: int = 0
    delta: Delta = Delta()
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Model):
    """One server-sent event of a streamed chat completion. With
    ``stream_options={"include_usage": True}`` the last chunk has no choices and a ``usage``."""

    id: str = ""
    object: str = "chat.completion.chunk"
    created: int = 0
    model: str = ""
    choices: list[ChunkChoice] = []
    usage: Usage | None = None


class CompletionLogprobs(_Model):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = []


class CompletionChoice(_Model):
    index: int = 0
    text: str = ""
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(_Model):
    """The answer of ``POST /v1/completions`` (also each streamed chunk of it)."""

    id: str = ""
    object: str = "text_completion"
    created: int = 0
    model: str = ""
    choices: list[CompletionChoice] = []
    usage: Usage | None = None


class Model(_Model):
    """One entry of ``GET /v1/models``."""

    id: str
    object: str = "model"
    created: int = 0
    owned_by: str | None = None
    max_model_len: int | None = None
