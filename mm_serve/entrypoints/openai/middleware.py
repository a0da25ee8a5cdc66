"""ASGI middleware of the API server: API key, request body limit, response counting, and
cancelling a handler when its client goes away."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable
from typing import Any

from fastapi import Request
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mm_serve.entrypoints.openai.errors import APIError, to_api_error
from mm_serve.entrypoints.openai.metrics import ServerMetrics

# Endpoints counted by name in the metrics; others are counted as "other".
COUNTED_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"


class RequestGuard:
    """Checks every HTTP request before the app sees it and counts the responses.

    - ``/v1/*`` needs ``Authorization: Bearer <api_key>`` when ``api_key`` is set (401).
    - A body above ``max_body_bytes`` is a 413: at once when ``Content-Length`` says so, else
      as soon as the received bytes pass the limit.
    - Responses of ``/v1/*`` are counted by endpoint and status (``ServerMetrics``).
    """

    def __init__(
        self, app: ASGIApp, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = 500

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            error = self._check(scope)
            if error is not None:
                await error.response()(scope, receive, send_counted)
            else:
                await self.app(scope, self._limited(receive), send_counted)
        finally:
            if path.startswith("/v1/"):
                endpoint = path if path in COUNTED_ENDPOINTS else "other"
                self.metrics.observe_response(endpoint, status)

    def _check(self, scope: Scope) -> APIError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"].startswith("/v1/"):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            valid = scheme.lower() == "bearer" and hmac.compare_digest(
                token.strip().encode(), self.api_key.encode()
            )
            if not valid:
                return APIError(
                    401,
                    "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                    "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"The request body is larger than the limit of {self.max_body_bytes} bytes.",
            "request_too_large",
        )

    def _limited(self, receive: Receive) -> Receive:
        received = 0

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    # FastAPI re-raises HTTPExceptions from reading the body: a 413 answer.
                    raise HTTPException(413, self._too_large().message)
            return message

        return receive_limited


async def until_disconnected(request: Request, handler: Awaitable[Any]) -> Any:
    """Run ``handler``; if the client disconnects first, cancel it (which aborts its engine
    requests) and answer 499. Its exceptions come back as ``APIError``s.

    Needed because the server does not cancel a handler when its client goes away (streamed
    responses are watched by ``StreamingResponse`` itself once they start).
    """
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    try:
        return task.result()
    except Exception as e:
        raise to_api_error(e) from e


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
