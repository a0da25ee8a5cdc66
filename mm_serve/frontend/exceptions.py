"""Errors of the engine core process as its clients see them."""

from __future__ import annotations


class EngineStartupError(RuntimeError):
    """The engine core process failed to start; the message carries its error."""


class EngineDeadError(RuntimeError):
    """The engine core process is gone (crashed, killed or shut down); the server must exit."""


class EngineRequestError(ValueError):
    """The engine refused or dropped one request (``kind``: "invalid_request" or "internal")."""

    def __init__(self, request_id: str, message: str, kind: str = "invalid_request") -> None:
        super().__init__(message)
        self.request_id = request_id
        self.kind = kind


class InvalidParamError(ValueError):
    """A request value at fault that the API names in its 400's ``param`` (e.g.
    ``mm_processor_kwargs``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
