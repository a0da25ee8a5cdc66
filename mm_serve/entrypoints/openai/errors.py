"""Every failure as OpenAI-style error JSON with the right status code.

Body: ``{"error": {"message", "type", "param", "code"}}``. Statuses (``type`` / ``code``):

- 400 ``invalid_request_error``: not JSON (``invalid_json``); a field of the wrong type or
  missing (``invalid_type`` / ``missing_required_parameter``, ``param`` as OpenAI names it:
  ``messages[0].content[0].image_url.url``); ``stream_options`` without ``stream``; values out
  of range; a bad image, base64 or image URL; too many or too large images; image placeholders
  without images; a prompt beyond the context (``context_length_exceeded``); a request the
  engine refuses.
- 401 ``authentication_error`` / ``invalid_api_key``: ``--api-key`` set, key missing/wrong.
- 404 ``invalid_request_error`` / ``model_not_found``: an unknown model (unknown path: no code).
- 405 ``invalid_request_error``: a known path with another method.
- 413 ``invalid_request_error`` / ``request_too_large``: above ``--max-request-body-bytes``.
- 429 ``rate_limit_error`` / ``server_overloaded``: beyond ``--max-concurrent-requests``; with
  ``Retry-After: 1``.
- 500 ``server_error`` / ``internal_error``: a bug; the traceback goes to the server log only.
- 503 ``server_error`` / ``engine_dead``: the engine core is gone; the server is exiting.
- 499 (no body): the client went away (counted in the metrics only)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from mm_serve.entrypoints.openai.protocol import error_body
from mm_serve.frontend.exceptions import EngineDeadError, EngineRequestError

logger = logging.getLogger(__name__)

_TYPES = {401: "authentication_error", 429: "rate_limit_error"}


class APIError(Exception):
    """An error answered as ``ErrorResponse`` JSON with HTTP status ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers

    @property
    def type(self) -> str:
        """OpenAI's error ``type`` for the status."""
        if self.status >= 500:
            return "server_error"
        return _TYPES.get(self.status, "invalid_request_error")

    def body(self) -> dict:
        """The ``ErrorResponse`` as a JSON-ready dict."""
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        """The HTTP response: status, ``ErrorResponse`` JSON and any headers."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400: the request is well-formed but its values are not acceptable."""
    return APIError(400, message, code=code, param=param)


def engine_dead_error() -> APIError:
    """The 503 of every request once the engine core is gone."""
    return APIError(503, "The engine is not running; the server is shutting down.", "engine_dead")


def internal_error() -> APIError:
    """The 500 of a bug; the details stay in the server log."""
    return APIError(
        500, "Internal server error (the server log has the details).", "internal_error"
    )


def to_api_error(exc: BaseException) -> APIError:
    """The ``APIError`` for any exception of request handling; logs unexpected ones with
    their traceback (they become a 500 that names no internals)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_dead_error()
    if isinstance(exc, EngineRequestError) and exc.kind == "internal":
        logger.error("The engine failed request %s: %s", exc.request_id, exc)
        return internal_error()
    if isinstance(exc, ValueError):
        return bad_request(str(exc), param=getattr(exc, "param", None))
    logger.error("Request failed", exc_info=(type(exc), exc, exc.__traceback__))
    return internal_error()


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn the ``ValueError``s (and engine errors) raised inside into ``APIError``s: around
    code whose ``ValueError``s are the request's fault (prompt and image processing,
    sampling parameters, the engine's verdict)."""
    try:
        yield
    except (ValueError, EngineDeadError) as e:
        raise to_api_error(e) from e


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """The 400 of a body that is not JSON or does not match the schema, from pydantic's
    ``errors()``: the message lists up to five problems, ``param`` names the first field."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return bad_request("The request body is not valid JSON.", code="invalid_json")
    problems = [(_param(e.get("loc", ())), e.get("type"), e.get("msg")) for e in errors]
    # A union (content: a string or a list of parts) fails once per member: a member that got
    # further into the input (messages[0].content[0].image_url) says more than one that did
    # not (messages[0].content is no string).
    params = [p for p, _, _ in problems if p]
    problems = [p for p in problems if not any(_inside(other, p[0]) for other in params)]
    param, kind, _ = problems[0] if problems else (None, None, None)
    listed = "; ".join(
        f"{p}: {message}" if p else "the body must be a JSON object"
        for p, _, message in problems[:5]
    )
    code = "missing_required_parameter" if kind == "missing" else "invalid_type"
    return bad_request(f"Invalid request: {listed}", param=param, code=code)


def _param(loc: Sequence[str | int]) -> str | None:
    """A pydantic error location as OpenAI names a field (``messages[0].content``): the body
    prefix, union member labels (``str``, ``list[...]``) and tagged-union tags dropped."""
    name, after_tagged_union, skip_tag = "", False, False
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
            skip_tag, after_tagged_union = after_tagged_union, False
        elif skip_tag:  # the tag of a tagged-union member ("image_url"), not a field
            skip_tag = False
        elif "[" in part or part in _MEMBER_LABELS:
            after_tagged_union = "tagged-union[" in part
        elif part != "body" or name:
            name += f".{part}" if name else part
    return name or None


def _inside(param: str, outer: str | None) -> bool:
    """``param`` names a field inside ``outer`` (``a[0].b`` is inside ``a``)."""
    return outer is not None and param.startswith(outer) and param[len(outer) :][:1] in (".", "[")


# pydantic's labels of plain union members in error locations.
_MEMBER_LABELS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error raised by a route as ``ErrorResponse`` JSON."""

    async def _respond(request: Request, exc: Exception) -> JSONResponse:
        return to_api_error(exc).response()

    for exc_class in (APIError, EngineDeadError, Exception):
        app.add_exception_handler(exc_class, _respond)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type", "")
        media_type = content_type.split(";")[0].strip().lower()
        if media_type and media_type != "application/json" and not media_type.endswith("+json"):
            # FastAPI reads such a body as bytes: say why, not that the body is no object.
            message = f"The body must be JSON sent as application/json, not {content_type!r}."
            return bad_request(message, code="invalid_content_type").response()
        return validation_error(exc.errors()).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        code = "request_too_large" if exc.status_code == 413 else None
        return APIError(exc.status_code, str(exc.detail), code, headers=exc.headers).response()
