"""Images to ``image_url`` content parts: paths and bytes become base64 ``data:`` URLs.

An image may be a path (``str`` or ``pathlib.Path``), encoded bytes (PNG, JPEG, ...), a PIL
image (encoded as PNG) or a URL string (``http(s)://``, ``data:``, ``file://``), which is passed
through untouched: the server fetches it if its ``--allowed-media-domains`` /
``--allowed-local-media-path`` allow it.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from PIL.Image import Image

ImageInput: TypeAlias = "str | Path | bytes | bytearray | memoryview | Image"

_URL_PREFIXES = ("http://", "https://", "data:", "file://")
# Magic bytes → MIME type; anything else is sent as application/octet-stream and the server
# decides (it sniffs the content, not the declared type).
_MAGIC = [
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
    (b"II*\x00", "image/tiff"),
    (b"MM\x00*", "image/tiff"),
]


def sniff_mime_type(data: bytes) -> str:
    """The MIME type of encoded image bytes from their first bytes."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    for magic, mime in _MAGIC:
        if data.startswith(magic):
            return mime
    return "application/octet-stream"


def bytes_to_data_url(data: bytes, mime_type: str | None = None) -> str:
    """``data:<mime>;base64,<data>``; the MIME type is sniffed when not given."""
    mime_type = mime_type or sniff_mime_type(data)
    return f"data:{mime_type};base64,{base64.b64encode(data).decode('ascii')}"


def image_to_url(image: ImageInput) -> str:
    """The URL to send for one image (see the module docstring for the accepted kinds).

    Raises:
        FileNotFoundError: a path that does not exist.
        TypeError: an object that is none of the accepted kinds.
    """
    if isinstance(image, str) and image.startswith(_URL_PREFIXES):
        return image
    if isinstance(image, (str, Path)):
        return bytes_to_data_url(Path(image).read_bytes())
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes_to_data_url(bytes(image))
    if hasattr(image, "save") and hasattr(image, "mode"):  # PIL.Image.Image, without importing PIL
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return bytes_to_data_url(buffer.getvalue(), "image/png")
    raise TypeError(
        f"Unsupported image of type {type(image).__name__}: pass a path, bytes, a PIL image "
        "or an http(s)/data/file URL."
    )


def image_part(image: ImageInput, uuid: str | None = None) -> dict[str, Any]:
    """An OpenAI ``image_url`` content part; ``uuid`` (optional) identifies the image to the
    server's caches in place of its content.

    Raises:
        FileNotFoundError, TypeError: as ``image_to_url``.
    """
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": image_to_url(image)}}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def user_message(text: str | None, images: Any = ()) -> dict[str, Any]:
    """A user message with the images first, then the text (the order VLM chat templates
    are trained on).

    Raises:
        FileNotFoundError, TypeError: as ``image_to_url``.
    """
    if isinstance(images, (str, Path, bytes, bytearray, memoryview)) or hasattr(images, "save"):
        images = [images]  # one image given bare
    content = [image_part(image) for image in images]
    if text is not None:
        content.append({"type": "text", "text": text})
    return {"role": "user", "content": content}
