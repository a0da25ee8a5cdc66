"""``POST /v1/embeddings``: OpenAI's embeddings request and response, with vLLM's chat form
(``messages``, for image inputs) and extensions."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from mm_serve.entrypoints.openai.protocol import ChatMessage, UsageInfo, _Request


class EmbeddingRequest(_Request):
    """OpenAI's ``input`` (a text, texts, token ids or lists of them) or vLLM's ``messages``
    (rendered by the chat template, images included): exactly one of them."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None
    encoding_format: Literal["float", "base64"] = "float"  # base64: float32 little-endian
    dimensions: int | None = None  # Matryoshka models only
    user: str | None = None  # accepted and ignored, as in chat
    # vLLM's extensions.
    normalize: bool | None = None  # None: the model's pooler config
    use_activation: bool | None = None  # vLLM's newer name of normalize
    add_special_tokens: bool | None = None  # None: true for input, false for messages
    add_generation_prompt: bool = False  # messages only
    continue_final_message: bool = False  # messages only
    mm_processor_kwargs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = 0


class EmbeddingResponseData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of float32 little-endian values


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo
