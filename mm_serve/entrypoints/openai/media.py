"""Image and video URLs of chat messages: which are allowed, and fetching the remote ones.

``image_url`` and ``video_url`` parts alike:

- ``data:image/...;base64,...`` (``data:video/...``): always allowed; decoded with the prompt
  (tokenizer thread); bad base64 is a 400.
- ``http(s)://host/...``: only for ``--allowed-media-domains`` (exact, case-insensitive);
  fetched with httpx with a timeout and a size cap; redirects only within the same host.
- ``file:///path``: only under ``--allowed-local-media-path`` (symlinks and ``..`` resolved),
  within the size cap.

Anything else is a 400."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

import httpx

from mm_serve.entrypoints.openai.errors import bad_request

MAX_REDIRECTS = 3
_bad = functools.partial(bad_request, param="messages")  # a 400 naming the messages


@dataclass(frozen=True)
class MediaConfig:
    """What image and video URLs may point at.

    ``allowed_domains``: hosts whose http(s) URLs are fetched (empty: none);
    ``allowed_local_path``: the folder whose files ``file://`` URLs may name (None: none);
    ``max_bytes``: the largest image or video fetched or read, in bytes; ``fetch_timeout_s``:
    the limit of one fetch (connect, each read), in seconds; ``max_images``, ``max_videos``:
    images and videos per request (``--limit-mm-per-prompt``).
    """

    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: str | None = None
    max_bytes: int = 20 << 20
    fetch_timeout_s: float = 10.0
    max_images: int = 16
    max_videos: int = 4


class MediaResolver:
    """Replaces a request's ``image_url`` and ``video_url`` parts by what the input processor
    takes.

    Owns an ``httpx.AsyncClient``: call ``aclose()`` when done.
    """

    def __init__(self, config: MediaConfig) -> None:
        self.config = config
        self._domains = {d.lower() for d in config.allowed_domains}
        self._local_root = (
            os.path.realpath(config.allowed_local_path) if config.allowed_local_path else None
        )
        timeout = httpx.Timeout(config.fetch_timeout_s)
        self._http = httpx.AsyncClient(follow_redirects=False, timeout=timeout, trust_env=False)

    async def aclose(self) -> None:
        """Close the HTTP client's connections."""
        await self._http.aclose()

    async def resolve(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages with each remote or local ``image_url`` (``video_url``) part replaced by
        an ``image`` (``video``) part holding the fetched bytes or the checked path
        (``data:`` URLs stay as they are).

        Raises:
            APIError: (400) more than ``max_images`` images or ``max_videos`` videos, a
                ``data:`` URL of another media type, a disallowed URL, a failed fetch, an item
                above ``max_bytes``.
        """
        limits = (("image", self.config.max_images), ("video", self.config.max_videos))
        for what, limit in limits:
            parts = [
                part
                for message in messages
                if isinstance(message.get("content"), list)
                for part in message["content"]
                if part.get("type") == f"{what}_url"
            ]
            if len(parts) > limit:
                raise _bad(
                    f"At most {limit} {what}s are allowed per request; got {len(parts)} "
                    "(--limit-mm-per-prompt)."
                )
            for part in parts:
                url = part[f"{what}_url"]["url"]
                if url.startswith("data:"):
                    _check_data_url_type(url, what)
                else:
                    item, uuid = await self.load(url, what), part.get("uuid")
                    part.clear()
                    part.update({"type": what, what: item, "uuid": uuid})
        return messages

    async def load(self, url: str, what: str = "image") -> bytes | str:
        """The image (``what``: or video) behind an http(s) URL (its bytes) or a file URL (its
        checked path).

        Raises:
            APIError: (400) see ``resolve``.
        """
        scheme = urlsplit(url).scheme.lower()
        if scheme in ("http", "https"):
            return await self._fetch(url, what)
        if scheme == "file":
            return self._local_path(url, what)
        raise _bad(
            f"{what.capitalize()} URLs must be data: URLs (base64), http(s) URLs of an allowed "
            "host or file: URLs under the allowed local folder."
        )

    def _local_path(self, url: str, what: str) -> str:
        if self._local_root is None:
            raise _bad(
                f"file: {what} URLs are not allowed (start the server with "
                "--allowed-local-media-path)."
            )
        path = os.path.realpath(unquote(urlsplit(url).path))
        if os.path.commonpath([path, self._local_root]) != self._local_root:
            raise _bad(f"The {what} file is outside the allowed folder.")
        try:
            size = os.stat(path).st_size
        except OSError:
            raise _bad(f"The {what} file does not exist.") from None
        self._check_size(size, what)
        return path

    async def _fetch(self, url: str, what: str) -> bytes:
        host = (urlsplit(url).hostname or "").lower()
        if host not in self._domains:
            raise _bad(
                f"{what.capitalize()} URLs of host {host!r} are not allowed "
                "(--allowed-media-domains)."
            )
        try:
            for _ in range(MAX_REDIRECTS + 1):
                async with self._http.stream("GET", url) as response:
                    if not response.is_redirect:
                        return await self._read(response, what)
                    url = urljoin(url, response.headers.get("location", ""))
                    target = urlsplit(url)
                    if target.scheme not in ("http", "https") or target.hostname != host:
                        raise bad_request(f"The {what} URL redirects to another host.")
        except httpx.TimeoutException:
            raise _bad(f"Fetching the {what} URL timed out.") from None
        except httpx.HTTPError as e:
            raise _bad(f"Fetching the {what} URL failed: {e}") from None
        raise _bad(f"The {what} URL redirects too many times.")

    async def _read(self, response: httpx.Response, what: str) -> bytes:
        if response.status_code != 200:
            raise _bad(f"Fetching the {what} URL failed: HTTP {response.status_code}.")
        length = response.headers.get("content-length")
        if length is not None and length.isdigit():
            self._check_size(int(length), what)
        data = bytearray()
        async for chunk in response.aiter_bytes():
            data += chunk
            self._check_size(len(data), what)
        return bytes(data)

    def _check_size(self, size: int, what: str) -> None:
        if size > self.config.max_bytes:
            raise _bad(f"The {what} is larger than the limit of {self.config.max_bytes} bytes.")


def _check_data_url_type(url: str, what: str) -> None:
    """Raises APIError (400) when the ``data:`` URL names a media type other than ``what``'s
    (``image/*`` for an image); an unnamed or ``application/octet-stream`` one leaves it to the
    decoder."""
    media_type = url[len("data:") :].split(",", 1)[0].split(";", 1)[0].strip().lower()
    if media_type not in ("", "application/octet-stream") and not media_type.startswith(f"{what}/"):
        raise _bad(f"A {what}_url data: URL must have a {what}/* media type, not {media_type!r}.")
