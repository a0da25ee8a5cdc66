"""Typed errors of the client SDK: one class per HTTP status family, plus connection errors.

The server answers every failure with OpenAI-style JSON, ``{"error": {"message", "type",
"code", "param"}}``; ``error_from_response`` turns that body (or any other body, for servers
that do not follow the format) into the matching ``APIError`` subclass.
"""

from __future__ import annotations

import json
from typing import Any

import httpx


class MMServeError(Exception):
    """Base of every error the SDK raises."""


class APIConnectionError(MMServeError):
    """The server could not be reached (after the client's retries), or the connection broke
    while a response was being read (never retried: the request may have run)."""


class APITimeoutError(APIConnectionError):
    """A read or write took longer than the client's ``timeout`` (seconds)."""


class APIResponseValidationError(MMServeError):
    """The server answered 2xx with a body that does not parse as the documented type."""


class APIError(MMServeError):
    """The server answered with an HTTP error status.

    Attributes:
        status_code: the HTTP status (e.g. 400).
        message: the server's human-readable message.
        type: the OpenAI error type (e.g. ``"BadRequestError"``), or None.
        code: the server's error code (often the status again), or None.
        param: the request field at fault, or None.
        body: the decoded JSON body (or the raw text) of the response.
    """

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str | None = None,  # OpenAI's field name
        code: Any = None,
        param: str | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(f"Error code {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.body = body


class BadRequestError(APIError):
    """400: a value or combination the server cannot serve (bad image, prompt too long...)."""


class AuthenticationError(APIError):
    """401: missing or wrong API key."""


class PermissionDeniedError(APIError):
    """403: the key is valid but not allowed to do this."""


class NotFoundError(APIError):
    """404: unknown model or route."""


class RequestTooLargeError(APIError):
    """413: the request body is above the server's ``--max-request-body-bytes``."""


class UnprocessableEntityError(APIError):
    """422: the request does not match the API's schema (wrong types, missing fields)."""


class RateLimitError(APIError):
    """429: the server is overloaded; try again later."""


class InternalServerError(APIError):
    """5xx: the server failed (its message carries no internals)."""


class ServiceUnavailableError(InternalServerError):
    """503: the server is overloaded or its engine is dead."""


_BY_STATUS: dict[int, type[APIError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    413: RequestTooLargeError,
    422: UnprocessableEntityError,
    429: RateLimitError,
    503: ServiceUnavailableError,
}


def error_class(status_code: int) -> type[APIError]:
    """The ``APIError`` subclass for an HTTP status."""
    return _BY_STATUS.get(status_code) or (InternalServerError if status_code >= 500 else APIError)


def error_from_payload(status_code: int, payload: Any, fallback: str = "") -> APIError:
    """An ``APIError`` from a decoded body: ``{"error": {...}}``, FastAPI's ``{"detail": ...}``
    or anything else (then ``fallback`` is the message)."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        message = str(error.get("message") or fallback)
        fields = (error.get("type"), error.get("code"), error.get("param"))
    elif isinstance(error, str):
        message, fields = error, (None, None, None)
    elif isinstance(payload, dict) and "detail" in payload:
        message, fields = str(payload["detail"]), (None, None, None)
    else:
        message, fields = fallback, (None, None, None)
    cls = error_class(status_code)
    return cls(status_code, message or f"HTTP {status_code}", *fields, body=payload)


def error_from_response(response: httpx.Response) -> APIError:
    """The error of a response with an error status; its body must have been read."""
    text = response.text
    try:
        payload: Any = json.loads(text)
    except ValueError:
        payload = text
    return error_from_payload(response.status_code, payload, text.strip() or response.reason_phrase)
