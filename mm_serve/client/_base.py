"""What the sync and async clients share: URLs, headers, request bodies, retry policy and
response decoding. No I/O here."""

from __future__ import annotations

from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from mm_serve.client.errors import (
    APIConnectionError,
    APIResponseValidationError,
    APITimeoutError,
    MMServeError,
    error_from_response,
)
from mm_serve.client.images import ImageInput, user_message
from mm_serve.client.types import Model

T = TypeVar("T", bound=BaseModel)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
# Only these are retried: the request never reached the server, so it cannot have run.
RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout)
_BACKOFF_S = 0.1  # first retry after 0.1 s, then doubled, capped below
_MAX_BACKOFF_S = 2.0


def connection_error(error: httpx.TransportError, url: str) -> APIConnectionError:
    """The SDK's error for an httpx transport error."""
    cls = APITimeoutError if isinstance(error, httpx.TimeoutException) else APIConnectionError
    return cls(f"Request to {url} failed: {type(error).__name__}: {error}")


class BaseClient:
    """Configuration and request building common to ``Client`` and ``AsyncClient``."""

    _http_class: type[httpx.Client] | type[httpx.AsyncClient]

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        api_key: str | None = None,
        timeout: float = 60.0,
        max_retries: int = 2,
        http_client: httpx.Client | httpx.AsyncClient | None = None,
    ) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}.")
        base_url = base_url.rstrip("/")
        # Accept the OpenAI-style base URL ending in /v1 as well.
        self.base_url = base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url
        self.api_key = api_key
        self.timeout = httpx.Timeout(timeout)
        self.max_retries = max_retries
        self._model_id: str | None = None
        self._owns_http = http_client is None
        self._http: Any = http_client or self._http_class()

    def _retry_delay(self, error: httpx.TransportError, attempt: int, url: str) -> float:
        """Seconds to wait before try ``attempt + 1`` after ``error``; raises the SDK's
        ``connection_error`` when ``error`` is not ``RETRYABLE`` or the retries are spent."""
        if isinstance(error, RETRYABLE) and attempt < self.max_retries:
            return min(_BACKOFF_S * 2**attempt, _MAX_BACKOFF_S)
        raise connection_error(error, url) from error

    def _build_request(self, method: str, path: str, **kwargs: Any) -> tuple[httpx.Request, bool]:
        """The request, and whether it streams (a JSON body with ``"stream": true``)."""
        stream = bool(kwargs.get("json", {}).get("stream")) if "json" in kwargs else False
        headers = {"Accept": "text/event-stream" if stream else "application/json"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        url = f"{self.base_url}{path}"
        request = self._http.build_request(
            method, url, headers=headers, timeout=self.timeout, **kwargs
        )
        return request, stream

    @staticmethod
    def _chat_body(
        messages: list[dict[str, Any]] | None,
        text: str | None,
        images: ImageInput | list[ImageInput] | tuple,
        model: str,
        stream: bool,
        params: dict[str, Any],
    ) -> dict[str, Any]:
        if messages is not None and (text is not None or images):
            raise ValueError("Pass either messages or text/images, not both.")
        if messages is None:
            if text is None and not images:
                raise ValueError("Pass messages, or text and/or images.")
            messages = [user_message(text, images)]
        return _with_stream({"model": model, "messages": messages, **params}, stream)

    @staticmethod
    def _completion_body(
        prompt: str | list[int], model: str, stream: bool, params: dict[str, Any]
    ) -> dict[str, Any]:
        return _with_stream({"model": model, "prompt": prompt, **params}, stream)

    def _first_model(self, models: list[Model]) -> str:
        if not models:
            raise MMServeError("The server lists no model at /v1/models.")
        self._model_id = models[0].id
        return self._model_id


def _with_stream(body: dict[str, Any], stream: bool) -> dict[str, Any]:
    """``body`` with ``"stream": true`` last when ``stream`` (a non-streaming body omits it)."""
    return {**body, "stream": True} if stream else body


def parse_models(payload: Any) -> list[Model]:
    """The entries of a ``GET /v1/models`` body.

    Raises:
        APIResponseValidationError: the body is not ``{"data": [{"id": ...}, ...]}``.
    """
    try:
        return [Model.model_validate(entry) for entry in payload["data"]]
    except (KeyError, TypeError, ValidationError) as e:
        raise APIResponseValidationError(f"Unexpected /v1/models body: {payload!r}") from e


def parse_health(response: httpx.Response) -> bool:
    """True for a 2xx ``GET /health``, False for 5xx; ``APIError`` for another error."""
    if response.status_code >= 500:
        return False
    if response.is_error:
        raise error_from_response(response)
    return True


def parse_text(response: httpx.Response) -> str:
    """The body of a read response as text. Raises ``APIError`` for an error status."""
    if response.is_error:
        raise error_from_response(response)
    return response.text


def parse_response(response: httpx.Response, cls: type[T] | None = None) -> Any:
    """The body of a read response: ``cls`` parsed from JSON, or the decoded JSON if ``cls``
    is None.

    Raises:
        APIError: the status is an error (the matching subclass).
        APIResponseValidationError: a 2xx body that is not the expected JSON.
    """
    if response.is_error:
        raise error_from_response(response)
    try:
        payload = response.json()
        return payload if cls is None else cls.model_validate(payload)
    except (ValueError, ValidationError) as e:
        raise APIResponseValidationError(
            f"Unexpected response from {response.request.url}: {e}"
        ) from e
