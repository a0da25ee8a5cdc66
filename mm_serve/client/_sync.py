"""The blocking client: ``Client`` and its ``Stream`` of chunks."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any, Generic, Literal, overload

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
from mm_serve.client.sse import iter_events
from mm_serve.client.types import ChatCompletion, ChatCompletionChunk, Completion, Model


class Stream(Generic[T]):
    """The chunks of one streamed response, parsed as they arrive, until ``data: [DONE]``.

    Iterate it once. ``close()`` (or leaving its ``with`` block) drops the connection, which
    makes the server abort the request. Never retried once started.

    Raises (while iterating):
        APIConnectionError: the connection broke or the stream ended without ``[DONE]``.
        APIError: the server sent an error event mid-stream.
    """

    def __init__(self, response: httpx.Response, cls: type[T]) -> None:
        self.response = response
        self._iterator = self._iterate(cls)

    def _iterate(self, cls: type[T]) -> Iterator[T]:
        try:
            yield from iter_events(self.response.iter_lines(), cls)
        except httpx.TransportError as e:
            raise connection_error(e, str(self.response.request.url)) from e
        finally:
            self.response.close()

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        return next(self._iterator)

    def close(self) -> None:
        self._iterator.close()
        self.response.close()

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client(BaseClient):
    """A blocking client of an mm_serve (or any OpenAI-compatible) server.

    Args:
        base_url: the server's root, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` too).
        api_key: sent as ``Authorization: Bearer <api_key>`` when not None.
        timeout: seconds for connecting and for each read/write (not the whole request).
        max_retries: extra attempts after a connection error (the request did not run), with
            0.1 s, 0.2 s, ... backoff; HTTP error statuses and broken streams are never retried.
        http_client: an ``httpx.Client`` to use; the caller keeps ownership and closes it.

    Every request method raises:
        APIConnectionError / APITimeoutError: unreachable after the retries, or a timeout.
        APIError subclasses: BadRequestError (400), AuthenticationError (401), NotFoundError
            (404), RequestTooLargeError (413), UnprocessableEntityError (422), RateLimitError
            (429), InternalServerError (5xx; ServiceUnavailableError for 503).
        APIResponseValidationError: a 2xx body of an unexpected shape."""

    _http_class = httpx.Client

    # ---- transport --------------------------------------------------------------------------

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Send with retries on connection errors only."""
        request, stream = self._build_request(method, path, **kwargs)
        for attempt in itertools.count():
            try:
                return self._http.send(request, stream=stream)
            except httpx.TransportError as e:
                time.sleep(self._retry_delay(e, attempt, str(request.url)))

    def _post(self, path: str, body: dict[str, Any], cls: type[T], chunk_cls: type[T]) -> Any:
        """A ``cls``, or for a streaming ``body`` a ``Stream`` of ``chunk_cls`` (an error status
        raises before any chunk)."""
        response = self._send("POST", path, json=body)
        if not body.get("stream"):
            return parse_response(response, cls)
        if response.is_error:
            try:
                response.read()
            finally:
                response.close()
            raise error_from_response(response)
        return Stream(response, chunk_cls)

    # ---- API --------------------------------------------------------------------------------

    def models(self) -> list[Model]:
        """The models the server serves (``GET /v1/models``)."""
        return parse_models(parse_response(self._send("GET", "/v1/models")))

    def default_model(self) -> str:
        """The server's first model id, fetched once and cached."""
        if self._model_id is None:
            self._first_model(self.models())
        return self._model_id  # type: ignore[return-value]

    def health(self) -> bool:
        """True when ``GET /health`` answers 2xx, False on 5xx (engine dead or overloaded).

        Raises:
            APIConnectionError: the server is unreachable after the retries.
            APIError: any other error status.
        """
        return parse_health(self._send("GET", "/health"))

    def metrics(self) -> str:
        """The Prometheus text of ``GET /metrics``."""
        return parse_text(self._send("GET", "/metrics"))

    # The return type by ``stream`` (the other arguments: the implementation's).
    @overload
    def chat(self, *args: Any, stream: Literal[False] = False, **kw: Any) -> ChatCompletion: ...
    @overload
    def chat(self, *args: Any, stream: Literal[True], **kw: Any) -> Stream[ChatCompletionChunk]: ...

    def chat(
        self,
        messages: list[dict[str, Any]] | None = None,
        *,
        text: str | None = None,
        images: ImageInput | list[ImageInput] | tuple = (),
        model: str | None = None,
        stream: bool = False,
        **params: Any,
    ) -> ChatCompletion | Stream[ChatCompletionChunk]:
        """``POST /v1/chat/completions``.

        Args:
            messages: OpenAI chat messages; or leave None and give ``text`` and/or ``images``
                (one user message: the images, then the text).
            images: paths, bytes, PIL images or http(s)/data/file URLs (see ``image_to_url``).
            model: the model id; None takes the server's first model (cached).
            stream: return a ``Stream`` of ``ChatCompletionChunk`` instead of waiting.
            **params: any other request field, sent as is: ``max_tokens``, ``temperature``,
                ``top_p``, ``top_k``, ``min_p``, ``n``, ``seed``, ``stop``, ``logprobs``,
                ``top_logprobs``, ``stream_options``, ``cache_salt``, ...

        Raises:
            ValueError: both or neither of ``messages`` and ``text``/``images``.
            FileNotFoundError, TypeError: an image that cannot be read or is of an unknown kind.
            APIError, APIConnectionError: see the class docstring. With ``stream=True`` an error
                status raises here, before any chunk.
        """
        body = self._chat_body(messages, text, images, model or "", stream, params)
        body["model"] = model or self.default_model()
        return self._post("/v1/chat/completions", body, ChatCompletion, ChatCompletionChunk)

    def completions(
        self, prompt: str | list[int], *, model: str | None = None, stream: bool = False, **params
    ) -> Completion | Stream[Completion]:
        """``POST /v1/completions`` for a text prompt (or token ids); ``params`` and errors as
        ``chat``."""
        body = self._completion_body(prompt, model or self.default_model(), stream, params)
        return self._post("/v1/completions", body, Completion, Completion)

    # ---- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection pool (unless the caller passed ``http_client``)."""
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
