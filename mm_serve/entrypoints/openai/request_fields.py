"""Which undeclared request fields are refused and which are ignored (OpenAI's and vLLM's
fields that this server does not implement: a 400 naming them; fields unknown to both: a
warning, as vLLM does)."""

from __future__ import annotations

import logging

from pydantic import BaseModel

from mm_serve.entrypoints.openai.errors import bad_request
from mm_serve.entrypoints.openai.protocol import UNSUPPORTED_FIELDS, UNSUPPORTED_MESSAGE_FIELDS

logger = logging.getLogger(__name__)

_logged_unknown_fields: set[str] = set()


def reject_undeclared_fields(request: BaseModel) -> None:
    """A field of OpenAI's API or of vLLM's extensions that this server does not implement
    (``protocol.UNSUPPORTED_FIELDS``) is refused; any other undeclared top-level field is
    unknown to both and ignored, with one warning per field name in the server's log (as
    vLLM does).

    A chat message's non-null undeclared fields are judged alike: those of
    ``protocol.UNSUPPORTED_MESSAGE_FIELDS`` are refused (``messages[i].name``), others ignored
    with a warning. Content parts are a closed schema: any non-null undeclared key in a part
    or in its ``image_url`` / ``video_url`` is refused (``messages[i].content[j].key``).

    Raises:
        APIError: (400) naming the first unsupported field.
    """
    extra = sorted(request.model_extra or ())
    for name in extra:
        if name in UNSUPPORTED_FIELDS:
            raise bad_request(f"Unsupported field {name!r}.", param=name)
    unknown = list(extra)
    for index, message in enumerate(getattr(request, "messages", None) or ()):
        for name, value in sorted((message.model_extra or {}).items()):
            if value is None:
                continue  # nothing asked (an SDK's dump of an earlier reply)
            if name in UNSUPPORTED_MESSAGE_FIELDS:
                param = f"messages[{index}].{name}"
                raise bad_request(f"Unsupported field {param!r}.", param=param)
            unknown.append(f"messages[].{name}")
        _reject_part_keys(index, message.content)
    for name in unknown:
        if name not in _logged_unknown_fields:
            _logged_unknown_fields.add(name)
            logger.warning("Ignoring the unknown request field %r.", name)


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
                    raise bad_request(f"Unsupported field {param!r}.", param=param)
