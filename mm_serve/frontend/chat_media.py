"""The images and videos of chat messages: OpenAI-style content parts taken out of the
messages (which keep a bare ``{"type": "image"}`` or ``{"type": "video"}`` part for the chat
template to render as the model's placeholder) and made the prompt's ``multi_modal_data``."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any


def media_from_url(url: str, what: str = "image") -> bytes | str:
    """``data:<mime>;base64,...`` → bytes; ``file://path`` or a plain path → the path.

    ``what`` ("image" or "video") names the media in the messages.

    Raises:
        ValueError: on a malformed data URL or a remote URL (not fetched by the offline API).
    """
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if ";base64" not in header:
            raise ValueError(f"{what.capitalize()} data URLs must be base64-encoded.")
        try:
            return base64.b64decode(payload, validate=True)
        except binascii.Error as e:
            raise ValueError(f"Invalid base64 {what} data: {e}") from e
    if url.startswith("file://"):
        return url[len("file://") :]
    if url.startswith(("http://", "https://")):
        raise ValueError(f"Remote {what} URLs are not fetched here; pass the bytes or a path.")
    return url


@dataclass
class ChatMedia:
    """A conversation's images and videos, each list in prompt order, with each item's
    ``uuid`` (None: identified by its content) and each image's OpenAI ``detail`` (or None)."""

    images: list[Any] = field(default_factory=list)
    image_uuids: list[str | None] = field(default_factory=list)
    image_details: list[str | None] = field(default_factory=list)
    videos: list[Any] = field(default_factory=list)
    video_uuids: list[str | None] = field(default_factory=list)

    def multi_modal_fields(self) -> dict[str, Any]:
        """The prompt dict's ``multi_modal_data``, ``multi_modal_uuids`` and
        ``multi_modal_detail`` entries (those with something in them)."""
        data, uuids, fields = {}, {}, {}
        for key, items, ids in (
            ("image", self.images, self.image_uuids),
            ("video", self.videos, self.video_uuids),
        ):
            if items:
                data[key] = items
            if any(uuid is not None for uuid in ids):
                uuids[key] = ids
        if data:
            fields["multi_modal_data"] = data
        if uuids:
            fields["multi_modal_uuids"] = uuids
        if any(detail is not None for detail in self.image_details):
            fields["multi_modal_detail"] = {"image": self.image_details}
        return fields


def split_chat_media(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], ChatMedia]:
    """OpenAI-style messages → (messages with ``{"type": "image"}`` and ``{"type": "video"}``
    parts, their media).

    Accepts ``image_url`` parts (``{"url": data/file URL or path, "detail": ...}``), ``image``
    parts (``{"image": PIL image | bytes | path}``), ``video_url`` parts (``{"url": data/file
    URL or path}``) and ``video`` parts (``{"video": bytes | path | frames}``); each may carry a
    ``"uuid"`` key (vLLM's name) that identifies the item in place of its content.
    """
    media = ChatMedia()
    rendered = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type")
            if kind in ("image_url", "image"):
                url = part.get("image_url")
                url = url if isinstance(url, dict) or url is None else {"url": url}
                image = part.get("image") if url is None else media_from_url(url["url"])
                media.images.append(image)
                media.image_details.append(None if url is None else url.get("detail"))
                media.image_uuids.append(part.get("uuid"))
                parts.append({"type": "image"})
            elif kind in ("video_url", "video"):
                url = part.get("video_url")
                url = url if isinstance(url, dict) or url is None else {"url": url}
                video = part.get("video") if url is None else media_from_url(url["url"], "video")
                media.videos.append(video)
                media.video_uuids.append(part.get("uuid"))
                parts.append({"type": "video"})
            else:
                parts.append(part)
        rendered.append({**message, "content": parts})
    return rendered, media
