"""Content hash of an image (its ``mm_hash``): the key of the processor cache, of the encoder
cache, and part of the prefix-cache hash of every KV block the image's placeholders overlap.

The idea is vLLM's ``MultiModalHasher`` (vllm/multimodal/hasher.py): hash what the client sent
(the encoded bytes, or a PIL image's pixels, or a client-supplied uuid standing in for them)
together with everything that changes the preprocessed result (the model and the processor's
settings), so that an image is hashed before it is decoded and a repeated image skips decoding
and preprocessing altogether. Encoding: type-tagged, length-framed (``block_hash._encode``),
hashed with xxh3-128 under a seed drawn at random once per deployment, so that colliding inputs
cannot be precomputed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

from mm_serve.cache.block_hash import _U64, _encode

_EXIF_ORIENTATION = 0x0112


class MultiModalHasher:
    """Hashes images for one model and one processor configuration.

    Args:
        model_id: the model as the user named it.
        processor_kwargs: every processor setting that changes the preprocessed pixels (the
            image processor's ``hash_kwargs()``); limits that only reject images are left out.
        seed: the xxh3 seed; None draws a random 64-bit one (``os.urandom``). Every process
            that must agree on hashes (the front end, preprocessing workers) has to share one
            hasher: it is picklable.
    """

    def __init__(
        self, model_id: str, processor_kwargs: Mapping[str, str], seed: int | None = None
    ) -> None:
        self.model_id = model_id
        self.processor_kwargs = tuple(sorted(processor_kwargs.items()))
        self.seed = int.from_bytes(os.urandom(8), "little") if seed is None else seed

    def hash_image(self, image: Any, uuid: str | None = None) -> str:
        """xxh3-128 hex digest (32 characters) of the model, the processor settings and either
        ``uuid`` (when given: it stands in for the content, which is then not read) or the
        image's content.

        ``image``: encoded bytes (``bytes``, ``bytearray``, ``memoryview``), a file path
        (``str`` or ``Path``: the file's bytes), or a ``PIL.Image.Image`` (mode, size, palette,
        transparency, EXIF orientation and raw pixel bytes). The same file given as a path or
        as bytes hashes equally; the same picture encoded twice (another JPEG quality) does not.

        Raises:
            ValueError: a missing file, a PIL image whose pixels cannot be read (truncated
                data), or an ``image`` of another type.
        """
        hasher = self._hasher()
        if not _update_as_sent(hasher, image, uuid, "Image"):
            if not _is_pil_image(image):
                raise ValueError(
                    f"Cannot load an image from a {type(image).__name__}; pass bytes, a path "
                    "or a PIL image."
                )
            metadata, pixels = _pil_content(image)
            _update(hasher, "pil", metadata, pixels)
        return hasher.hexdigest()

    def hash_video(self, video: Any, uuid: str | None = None) -> str:
        """xxh3-128 hex digest of the model, the video processor's settings (this hasher's
        ``processor_kwargs``: frame sampling, pixel bounds), a "video" tag, and ``uuid`` or
        the video's content: the encoded file as sent (bytes, or a path's bytes: the same
        file hashes equally either way; hashing the bytes costs far less than decoding), or
        frames given decoded, through their ``content_for_hash()`` (``(metadata, pixel
        bytes)``: shape, dtype, frame rate, pixels).

        Raises:
            ValueError: a missing file, or a ``video`` of another type.
        """
        hasher = self._hasher("video")
        if not _update_as_sent(hasher, video, uuid, "Video"):
            if not hasattr(video, "content_for_hash"):
                raise ValueError(f"Cannot hash a video given as a {type(video).__name__}.")
            metadata, pixels = video.content_for_hash()
            _update(hasher, "frames", metadata, pixels)
        return hasher.hexdigest()

    def _hasher(self, *tags: str) -> Any:
        """An xxh3-128 hasher (this hasher's seed) fed the model, the processor settings and
        ``tags``."""
        hasher = xxhash.xxh3_128(seed=self.seed)
        header: list[bytes] = []
        _encode((self.model_id, self.processor_kwargs, *tags), header)
        hasher.update(b"".join(header))
        return hasher


def _update_as_sent(hasher: Any, item: Any, uuid: str | None, what: str) -> bool:
    """Feed ``hasher`` ``uuid`` when given, else ``item`` as the client sent it encoded:
    bytes, or a file path (its bytes). Returns False, feeding nothing, for an item of any
    other type (decoded pixels or frames).

    Raises:
        ValueError: a path that is no file ("``what`` file not found").
    """
    if uuid is not None:
        _update(hasher, "uuid", (), uuid.encode("utf-8"))
    elif isinstance(item, (bytes, bytearray, memoryview)):
        _update(hasher, "bytes", (), item)
    elif isinstance(item, (str, Path)):
        path = Path(item)
        if not path.is_file():
            raise ValueError(f"{what} file not found: {str(path)!r}.")
        _update(hasher, "bytes", (), path.read_bytes())
    else:
        return False
    return True


def _update(hasher: Any, kind: str, metadata: tuple, payload: bytes | bytearray | memoryview):
    """Frame ``(kind, metadata)`` then the payload (tag, length, bytes) without copying it."""
    header: list[bytes] = []
    _encode((kind, metadata), header)
    payload = memoryview(payload).cast("B")
    header.append(b"B" + _U64.pack(len(payload)))
    hasher.update(b"".join(header))
    hasher.update(payload)


def _is_pil_image(value: Any) -> bool:
    # No PIL import here (cache/ imports neither PIL nor torch): a PIL image can only exist
    # once PIL.Image has been imported.
    pil_image = sys.modules.get("PIL.Image")
    return pil_image is not None and isinstance(value, pil_image.Image)


def _pil_content(image: Any) -> tuple[tuple, bytes]:
    """(metadata that changes the decoded RGB pixels, raw pixel bytes) of a PIL image."""
    try:
        pixels = image.tobytes()
    except (OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"Cannot read the image's pixels: {e}") from e
    palette = None if image.palette is None else (image.palette.mode, image.palette.tobytes())
    transparency = image.info.get("transparency")
    try:
        orientation = image.getexif().get(_EXIF_ORIENTATION)
    except (ValueError, OSError, SyntaxError, TypeError, KeyError):
        orientation = None  # malformed EXIF: load_image ignores it too
    metadata = (
        image.mode,
        tuple(image.size),
        palette,
        None if transparency is None else repr(transparency),
        orientation if isinstance(orientation, int) else None,
    )
    return metadata, pixels
