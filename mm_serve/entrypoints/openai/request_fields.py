"""Undeclared request fields: each one the request asks for is a 400 naming it, never a
silent 200. A field of OpenAI's API or of vLLM's extensions that this server does not implement
is "unsupported"; any other is "unknown"."""

from __future__ import annotations

from pydantic import BaseModel

from mm_serve.entrypoints.openai.errors import bad_request
from mm_serve.entrypoints.openai.protocol import UNSUPPORTED_FIELDS, UNSUPPORTED_MESSAGE_FIELDS


def reject_undeclared_fields(request: BaseModel) -> None:
    """Refuse the request's first undeclared field: at the top level, in a chat message
    (``messages[i].name``), in a content part or its ``image_url`` / ``video_url``
    (``messages[i].content[j].key``). A null value asks for nothing and passes (an SDK's dump
    of an earlier reply), except a field of ``protocol.UNSUPPORTED_FIELDS``.

    Raises:
        APIError: (400) naming the field.
    """
    for name, value in sorted((request.model_extra or {}).items()):
        if name in UNSUPPORTED_FIELDS or value is not None:
            raise _undeclared(name, name in UNSUPPORTED_FIELDS)
    for index, message in enumerate(getattr(request, "messages", None) or ()):
        for name, value in sorted((message.model_extra or {}).items()):
            if value is not None:
                param = f"messages[{index}].{name}"
                raise _undeclared(param, name in UNSUPPORTED_MESSAGE_FIELDS)
        _reject_part_keys(index, message.content)


def _undeclared(param: str, unsupported: bool) -> Exception:
    if unsupported:
        return bad_request(f"Unsupported field {param!r}.", param=param)
    return bad_request(f"Unknown field {param!r}: not a parameter of this API.", param=param)


def _reject_part_keys(index: int, content: str | list[BaseModel] | None) -> None:
    """Raises APIError (400) naming the first non-null undeclared key of message ``index``'s
    content parts or of their ``image_url`` / ``video_url`` objects."""
    for j, part in enumerate(content if isinstance(content, list) else ()):
        objects = {"": part} | {
            f"{k}.": v for k, v in vars(part).items() if isinstance(v, BaseModel)
        }
        for prefix, obj in objects.items():
            for key, value in (obj.model_extra or {}).items():
                if value is not None:
                    param = f"messages[{index}].content[{j}].{prefix}{key}"
                    raise _undeclared(param, unsupported=False)
