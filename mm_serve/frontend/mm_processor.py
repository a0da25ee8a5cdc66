"""Image prompts: hash the images, preprocess them (processor cache, then the process pool),
expand their placeholders.

A VLM prompt carries one image-token placeholder per image (Qwen2-VL's chat template writes
``<|vision_start|><|image_pad|><|vision_end|>``, LLaVA's ``<image>``). Each placeholder is
expanded to as many tokens as the image has embeddings, and its ``PlaceholderRange`` and
``mm_hash`` go on the request. A request may preprocess its images otherwise than the server
(vLLM's ``mm_processor_kwargs``, OpenAI's ``detail: "low"``): the variant's settings are hashed
into its images' ``mm_hash``, so its images never share a cache entry (processor cache, encoder
cache, prefix cache) with the same images preprocessed otherwise. Work is split into
``submit`` (hash, cache lookup, queue the misses: fast) and ``PendingImages.result()`` (wait,
expand), so that the caller can tokenize and schedule other prompts while the pool works.
"""

from __future__ import annotations

import base64
import binascii
import functools
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from mm_serve.cache.mm_hash import MultiModalHasher
from mm_serve.cache.processor_cache import ProcessorCache
from mm_serve.config import ModelConfig, MultiModalConfig
from mm_serve.encoders.base import ImageProcessor, ProcessedImage
from mm_serve.encoders.processors import get_image_processor
from mm_serve.frontend.exceptions import InvalidParamError
from mm_serve.preprocess.pool import PreprocessPool, PreprocessResult
from mm_serve.request import MultiModalFeature, PlaceholderRange

# OpenAI's image_url "detail": "low" preprocesses with ``ImageProcessor.low_detail()`` (Qwen2-VL:
# at most 448 x 448 pixels), "high" and "auto" (or none) as the server does.
IMAGE_DETAILS = ("auto", "low", "high")


def image_from_url(url: str) -> bytes | str:
    """``data:image/...;base64,...`` → bytes; ``file://path`` or a plain path → the path.

    Raises:
        ValueError: on a malformed data URL or a remote URL (not fetched by the offline API).
    """
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if ";base64" not in header:
            raise ValueError("Image data URLs must be base64-encoded.")
        try:
            return base64.b64decode(payload, validate=True)
        except binascii.Error as e:
            raise ValueError(f"Invalid base64 image data: {e}") from e
    if url.startswith("file://"):
        return url[len("file://") :]
    if url.startswith(("http://", "https://")):
        raise ValueError("Remote image URLs are not fetched here; pass the bytes or a path.")
    return url


@dataclass
class PendingImages:
    """A prompt's images on their way through the processor cache and the preprocessing pool.

    ``items[i]`` is image i's ``ProcessedImage`` (a processor-cache hit) or the pool's future
    of it. ``result()`` waits for the pool and expands the placeholders.
    """

    image_token_id: int
    token_ids: list[int]
    mm_hashes: list[str]
    items: list[ProcessedImage | Future[PreprocessResult]]
    max_image_tokens: int

    def done(self) -> bool:
        """Whether every image is preprocessed (or failed): ``result()`` will not block."""
        return all(not isinstance(item, Future) or item.done() for item in self.items)

    def result(self) -> tuple[list[int], list[MultiModalFeature]]:
        """Wait for the images; then (token ids with the i-th placeholder replaced by image i's
        ``num_tokens`` placeholder tokens, or its ``token_ids`` where it has them, one feature
        per image in prompt order).

        Raises:
            ValueError: an image failed in the pool (undecodable, above ``max_pixels``, ...).
            InvalidParamError: an image expands to more tokens than ``max_image_tokens`` (the
                server's largest, which sizes the encoder's budgets), as a request's
                ``mm_processor_kwargs`` can make it.
        """
        processed = [
            item.result().to_processed_image() if isinstance(item, Future) else item
            for item in self.items
        ]
        for item in processed:
            if item.num_tokens > self.max_image_tokens:
                raise InvalidParamError(
                    "mm_processor_kwargs",
                    f"An image expands to {item.num_tokens} tokens, more than the "
                    f"{self.max_image_tokens} this server takes per image; lower "
                    "mm_processor_kwargs' max_pixels (or min_pixels).",
                )
        expanded: list[int] = []
        features: list[MultiModalFeature] = []
        images = iter(zip(self.mm_hashes, processed, strict=True))
        for token_id in self.token_ids:
            if token_id != self.image_token_id:
                expanded.append(token_id)
                continue
            mm_hash, item = next(images)
            placeholder = PlaceholderRange(offset=len(expanded), length=item.num_tokens)
            features.append(MultiModalFeature(mm_hash, placeholder, data=item))
            if item.token_ids is None:
                expanded.extend([self.image_token_id] * item.num_tokens)
            else:  # the image's own tokens: tile tags, newlines, image tokens (Idefics3)
                expanded.extend(item.token_ids)
        return expanded, features


class MultiModalProcessor:
    """Turns a VLM prompt's images into ``MultiModalFeature``s and expands its placeholders.

    ``submit`` hashes each image in the calling thread (xxh3 over the encoded bytes costs far
    less than decoding), looks the hash up in the processor cache, and sends only misses to the
    preprocessing pool, each distinct image once even while it is in flight. Finished images
    enter the cache as soon as the pool returns them. Thread-safe; owns the pool: call
    ``shutdown()`` when done.
    """

    def __init__(self, model_config: ModelConfig, mm_config: MultiModalConfig) -> None:
        self.image_token_id = model_config.image_token_id
        self.max_image_tokens = mm_config.max_image_tokens
        self.processor = get_image_processor(
            model_config.path,
            model_config.hf_config,
            mm_config.processor_max_pixels,
            mm_config.mm_processor_kwargs,
        )
        self.hasher = MultiModalHasher(model_config.model, self.processor.hash_kwargs())
        self.cache = ProcessorCache(int(mm_config.mm_processor_cache_gb * (1 << 30)))
        self.pool = PreprocessPool(model_config, mm_config)
        self._in_flight: dict[str, Future[PreprocessResult]] = {}
        self._lock = threading.Lock()

    def submit(
        self,
        token_ids: list[int],
        images: list[Any],
        uuids: list[str | None] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        details: list[str | None] | None = None,
    ) -> PendingImages:
        """Start preprocessing a prompt's images; returns at once.

        ``uuids[i]``, when not None, identifies image i in place of its content (vLLM's
        ``multi_modal_uuids``): equal uuids share cache entries whatever the bytes.
        ``mm_processor_kwargs`` (``ImageProcessor.with_kwargs``) apply to every image on top of
        the server's; ``details[i]`` is image i's ``IMAGE_DETAILS`` value or None.

        Raises:
            ValueError: the prompt's placeholders and the images (or the uuids, or the
                details) differ in number, a uuid is not a str, a detail is unknown, or an
                image is of an unsupported type or a missing file.
            InvalidParamError: ``mm_processor_kwargs`` the image processor does not take.
        """
        num_placeholders = token_ids.count(self.image_token_id)
        if num_placeholders != len(images):
            raise ValueError(
                f"The prompt has {num_placeholders} image placeholders but {len(images)} "
                "images were given; each image needs exactly one placeholder."
            )
        uuids = [None] * len(images) if uuids is None else list(uuids)
        if len(uuids) != len(images):
            raise ValueError(f"Got {len(uuids)} image uuids for {len(images)} images.")
        if not all(uuid is None or isinstance(uuid, str) for uuid in uuids):
            raise ValueError("Image uuids must be strings or None.")
        details = [None] * len(images) if details is None else list(details)
        if len(details) != len(images):
            raise ValueError(f"Got {len(details)} image details for {len(images)} images.")
        variants = {
            d: self._variant(mm_processor_kwargs or {}, d, len(images)) for d in set(details)
        }
        # Hash all first: a bad image then queues nothing.
        mm_hashes = [
            variants[detail][1].hash_image(image, uuid)
            for image, uuid, detail in zip(images, uuids, details, strict=True)
        ]
        items = [
            self._lookup_or_submit(mm_hash, image, variants[detail][0])
            for mm_hash, image, detail in zip(mm_hashes, images, details, strict=True)
        ]
        return PendingImages(
            self.image_token_id, token_ids, mm_hashes, items, self.max_image_tokens
        )

    def _variant(
        self, mm_processor_kwargs: dict[str, Any], detail: str | None, num_images: int
    ) -> tuple[ImageProcessor | None, MultiModalHasher]:
        """(the processor of images with these settings in a prompt of ``num_images``
        images, None where it is the server's; the hasher whose hashes cover its settings)."""
        if detail is not None and detail not in IMAGE_DETAILS:
            raise ValueError(f"An image's detail must be one of {IMAGE_DETAILS}, not {detail!r}.")
        try:
            processor = self.processor.with_kwargs(mm_processor_kwargs)
        except ValueError as e:
            raise InvalidParamError("mm_processor_kwargs", str(e)) from e
        if detail == "low":
            processor = processor.low_detail()
        processor = processor.for_prompt(num_images)
        settings = processor.hash_kwargs()
        if settings == self.processor.hash_kwargs():
            return None, self.hasher
        hasher = MultiModalHasher(self.hasher.model_id, settings, seed=self.hasher.seed)
        return processor, hasher

    def shutdown(self) -> None:
        """Stop the preprocessing pool's processes (see ``PreprocessPool.shutdown``)."""
        self.pool.shutdown()

    def _lookup_or_submit(
        self, mm_hash: str, image: Any, processor: ImageProcessor | None
    ) -> ProcessedImage | Future[PreprocessResult]:
        with self._lock:
            item = self.cache.get(mm_hash)
            if item is not None:
                return item
            future = self._in_flight.get(mm_hash)
            if future is not None:
                return future
            future = self.pool.submit(image, processor)
            self._in_flight[mm_hash] = future
        future.add_done_callback(functools.partial(self._on_done, mm_hash))
        return future

    def _on_done(self, mm_hash: str, future: Future[PreprocessResult]) -> None:
        """Runs in the pool's manager thread: cache the image, end its in-flight entry."""
        failed = future.cancelled() or future.exception() is not None
        with self._lock:
            if self._in_flight.get(mm_hash) is future:
                del self._in_flight[mm_hash]
            if not failed:
                item = future.result().to_processed_image()
                self.cache.put(mm_hash, item, item.pixel_values.nbytes)


def split_chat_images(
    messages: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[Any], list[str | None], list[str | None]]:
    """OpenAI-style messages → (messages with ``{"type": "image"}`` parts, images in order,
    their uuids, their details).

    Accepts ``image_url`` parts (``{"url": data/file URL or path, "detail": ...}``) and
    ``image`` parts (``{"image": PIL image | bytes | path}``); either may carry a ``"uuid"``
    key (vLLM's name) that identifies the image in place of its content, else its uuid is
    None. An image's detail is its ``image_url``'s ``"detail"`` (``IMAGE_DETAILS``), else None.
    """
    images: list[Any] = []
    uuids: list[str | None] = []
    details: list[str | None] = []
    rendered = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type")
            if kind == "image_url":
                url = part["image_url"]
                url = url if isinstance(url, dict) else {"url": url}
                images.append(image_from_url(url["url"]))
                details.append(url.get("detail"))
            elif kind == "image":
                images.append(part.get("image"))
                details.append(None)
            else:
                parts.append(part)
                continue
            uuids.append(part.get("uuid"))
            parts.append({"type": "image"})
        rendered.append({**message, "content": parts})
    return rendered, images, uuids, details
