"""The asyncio client: ``AsyncClient`` and its ``AsyncStream`` of chunks (same API as
``Client``, with ``await`` and ``async for``)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any, Generic

import httpx

from mm_serve.client._base import (
    BaseClient,
    T,
    connection_error,
    parse_health,
    parse_models,
    parse_response,
    parse_text,
)
from mm_serve.client.errors import error_from_response
from mm_serve.client.images import ImageInput
from mm_serve.client.sse import aiter_events
from mm_serve.client.types import ChatCompletion, ChatCompletionChunk, Completion, Model


class AsyncStream(Generic[T]):
    """The async twin of ``Stream``: ``async for chunk in stream``; ``await stream.close()``
    (or leaving its ``async with`` block) drops the connection and aborts the request."""

    def __init__(self, response: httpx.Response, cls: type[T]) -> None:
        self.response = response
        self._iterator = self._iterate(cls)

    async def _iterate(self, cls: type[T]) -> AsyncIterator[T]:
        try:
            async for chunk in aiter_events(self.response.aiter_lines(), cls):
                yield chunk
        except httpx.TransportError as e:
            raise connection_error(e, str(self.response.request.url)) from e
        finally:
            await self.response.aclose()

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        return await self._iterator.__anext__()

    async def close(self) -> None:
        await self._iterator.aclose()
        await self.response.aclose()

    async def __aenter__(self) -> AsyncStream[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncClient(BaseClient):
    """An asyncio client; arguments, methods and errors as ``Client`` (``http_client`` is an
    ``httpx.AsyncClient``). Use ``async with AsyncClient(...) as client`` or ``await
    client.close()``."""

    _http_class = httpx.AsyncClient

    async def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Send with retries on connection errors only."""
        request, stream = self._build_request(method, path, **kwargs)
        for attempt in itertools.count():
            try:
                return await self._http.send(request, stream=stream)
            except httpx.TransportError as e:
                await asyncio.sleep(self._retry_delay(e, attempt, str(request.url)))

    async def _post(self, path: str, body: dict[str, Any], cls: type[T], chunk_cls: type[T]) -> Any:
        """As ``Client._post``, with an ``AsyncStream``."""
        response = await self._send("POST", path, json=body)
        if not body.get("stream"):
            return parse_response(response, cls)
        if response.is_error:
            try:
                await response.aread()
            finally:
                await response.aclose()
            raise error_from_response(response)
        return AsyncStream(response, chunk_cls)

    async def models(self) -> list[Model]:
        """The models the server serves (``GET /v1/models``)."""
        return parse_models(parse_response(await self._send("GET", "/v1/models")))

    async def default_model(self) -> str:
        """The server's first model id, fetched once and cached."""
        if self._model_id is None:
            self._first_model(await self.models())
        return self._model_id  # type: ignore[return-value]

    async def health(self) -> bool:
        """True when ``GET /health`` answers 2xx, False on 5xx; raises as ``Client.health``."""
        return parse_health(await self._send("GET", "/health"))

    async def metrics(self) -> str:
        """The Prometheus text of ``GET /metrics``."""
        return parse_text(await self._send("GET", "/metrics"))

    async def chat(
        self,
        messages: list[dict[str, Any]] | None = None,
        *,
        text: str | None = None,
        images: ImageInput | list[ImageInput] | tuple = (),
        model: str | None = None,
        stream: bool = False,
        **params: Any,
    ) -> ChatCompletion | AsyncStream[ChatCompletionChunk]:
        """``POST /v1/chat/completions``; arguments and errors as ``Client.chat``. With
        ``stream=True`` returns an ``AsyncStream`` once the server has accepted the request."""
        body = self._chat_body(messages, text, images, model or "", stream, params)
        body["model"] = model or await self.default_model()
        return await self._post("/v1/chat/completions", body, ChatCompletion, ChatCompletionChunk)

    async def completions(
        self, prompt: str | list[int], *, model: str | None = None, stream: bool = False, **params
    ) -> Completion | AsyncStream[Completion]:
        """``POST /v1/completions``; as ``Client.completions``."""
        body = self._completion_body(prompt, model or await self.default_model(), stream, params)
        return await self._post("/v1/completions", body, Completion, Completion)

    async def close(self) -> None:
        """Close the connection pool (unless the caller passed ``http_client``)."""
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
