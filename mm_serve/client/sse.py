"""Incremental server-sent-events parsing for streamed completions.

The server sends ``data: {json}`` events separated by blank lines and ends with
``data: [DONE]``. Lines are fed as they arrive, so each chunk is yielded as soon as its event
is complete; a stream that ends without ``[DONE]`` was cut off and raises.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Generic, TypeVar

from pydantic import BaseModel, ValidationError

from mm_serve.client.errors import (
    APIConnectionError,
    APIResponseValidationError,
    error_from_payload,
)

T = TypeVar("T", bound=BaseModel)
DONE = "[DONE]"


class SSEDecoder:
    """Collects the ``data:`` lines of one event; ``feed`` returns the event's data when the
    blank line that ends it arrives (comments and other fields are ignored, per the SSE spec)."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """One line, without its line terminator."""
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """The pending event's data (at a blank line or the end of the stream), if any."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def parse_event(data: str, cls: type[T]) -> T:
    """One event's JSON as ``cls``.

    Raises:
        APIError: the event is an error the server sent mid-stream (``{"error": {...}}``).
        APIResponseValidationError: the event is not valid JSON of ``cls``.
    """
    try:
        payload = json.loads(data)
    except ValueError as e:
        raise APIResponseValidationError(f"Stream event is not JSON: {data[:200]!r}") from e
    if isinstance(payload, dict) and "error" in payload:
        error = payload["error"]
        code = error.get("code") if isinstance(error, dict) else None
        status = code if isinstance(code, int) and 400 <= code < 600 else 500
        raise error_from_payload(status, payload, "The server reported an error mid-stream.")
    try:
        return cls.model_validate(payload)
    except ValidationError as e:
        raise APIResponseValidationError(f"Unexpected stream event: {e}") from e


class _Chunks(Generic[T]):
    """The chunks of ``cls`` in a stream's lines: ``feed`` each line; ``done`` once
    ``[DONE]`` came; ``end`` when the lines ran out first."""

    def __init__(self, cls: type[T]) -> None:
        self.cls = cls
        self.decoder = SSEDecoder()
        self.done = False

    def feed(self, line: str) -> list[T]:
        data = self.decoder.feed(line)
        self.done = data == DONE
        return [] if data is None or self.done else [parse_event(data, self.cls)]

    def end(self) -> None:
        if self.decoder.flush() != DONE:
            raise APIConnectionError(f"The stream ended before 'data: {DONE}'.")


def iter_events(lines: Iterator[str], cls: type[T]) -> Iterator[T]:
    """Chunks of ``cls`` from lines as they arrive, until ``[DONE]``.

    Raises:
        APIConnectionError: the stream ended without ``[DONE]``.
        APIError, APIResponseValidationError: as ``parse_event``.
    """
    chunks = _Chunks(cls)
    for line in lines:
        yield from chunks.feed(line)
        if chunks.done:
            return
    chunks.end()


async def aiter_events(lines: AsyncIterator[str], cls: type[T]) -> AsyncIterator[T]:
    """The async twin of ``iter_events``."""
    chunks = _Chunks(cls)
    async for line in lines:
        for chunk in chunks.feed(line):
            yield chunk
        if chunks.done:
            return
    chunks.end()
