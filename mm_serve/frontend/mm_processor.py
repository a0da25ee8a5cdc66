"""Image and video prompts: hash the items, preprocess them (processor cache, then the process
pool), expand their placeholders.

A VLM prompt carries one image-token placeholder per image (Qwen2-VL's chat template writes
``<|vision_start|><|image_pad|><|vision_end|>``, LLaVA's ``<image>``) and, for a model that
takes videos, one video-token placeholder per video (``<|video_pad|>``). Each placeholder is
expanded to as many tokens as the item has embeddings, and its ``PlaceholderRange`` and
``mm_hash`` go on the request. A request may preprocess its items otherwise than the server
(vLLM's ``mm_processor_kwargs``, OpenAI's ``detail: "low"``): the variant's settings are hashed
into its items' ``mm_hash``, so its items never share a cache entry (processor cache, encoder
cache, prefix cache) with the same items preprocessed otherwise. A video is hashed over its
file's bytes as sent (or its frames' pixels, given decoded) and the video processor's
settings (frame sampling, pixel bounds): the same file sampled otherwise is another video.
Work is split into ``submit`` (hash, cache lookup, queue the misses: fast) and
``PendingImages.result()`` (wait, expand), so that the caller can tokenize and schedule other
prompts while the pool works. A decoded (PIL) image whose preprocessing only copies its pixels
(``ImageProcessor.copies_only``: Qwen2-VL's processors, an RGB image at its target size) is
preprocessed in the calling thread instead: the pool's round trip pickles its pixels and
sends them through one pipe each way (1.2 MB for a 448x448 photo), and that set how fast the
offline ``LLM`` fed the first encode steps of a batch.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from mm_serve.cache.mm_hash import MultiModalHasher
from mm_serve.cache.processor_cache import ProcessorCache
from mm_serve.config import ModelConfig, MultiModalConfig
from mm_serve.encoders.base import ImageProcessor, ProcessedImage
from mm_serve.encoders.image_io import declared_pixels
from mm_serve.encoders.processors import get_image_processor, image_kwargs
from mm_serve.encoders.video_io import as_video_source
from mm_serve.encoders.video_processors import VideoProcessor, get_video_processor, video_kwargs
from mm_serve.frontend.exceptions import InvalidParamError
from mm_serve.messages.request import MultiModalFeature, PlaceholderRange
from mm_serve.preprocess.pool import PreprocessPool, PreprocessResult, preprocess_image

logger = logging.getLogger(__name__)

# OpenAI's image_url "detail": "low" preprocesses with ``ImageProcessor.low_detail()`` (Qwen2-VL:
# at most 448 x 448 pixels), "high" and "auto" (or none) as the server does.
IMAGE_DETAILS = ("auto", "low", "high")


@dataclass
class PendingImages:
    """A prompt's images and videos on their way through the processor cache and the
    preprocessing pool.

    ``items[i]`` is item i's ``ProcessedImage`` (a processor-cache hit) or the pool's future
    of it, ``modalities[i]`` its modality: the images in prompt order, then the videos.
    ``result()`` waits for the pool and expands the placeholders.
    """

    image_token_id: int
    token_ids: list[int]
    mm_hashes: list[str]
    items: list[ProcessedImage | Future[PreprocessResult]]
    max_image_tokens: int
    modalities: list[str] = field(default_factory=list)  # empty: all images
    video_token_id: int | None = None

    def done(self) -> bool:
        """Whether every item is preprocessed (or failed): ``result()`` will not block."""
        return all(not isinstance(item, Future) or item.done() for item in self.items)

    def result(self) -> tuple[list[int], list[MultiModalFeature]]:
        """Wait for the items; then (token ids with the i-th image (video) placeholder replaced
        by image (video) i's ``num_tokens`` placeholder tokens, or its ``token_ids`` where it
        has them, one feature per item in prompt order).

        Raises:
            ValueError: an item failed in the pool (undecodable, above ``max_pixels``, a video
                over the server's limits, ...).
            InvalidParamError: an image expands to more tokens than ``max_image_tokens`` (the
                server's largest, which sizes the encoder's budgets), as a request's
                ``mm_processor_kwargs`` can make it.
        """
        processed = [
            item.result().to_processed_image() if isinstance(item, Future) else item
            for item in self.items
        ]
        modalities = self.modalities or ["image"] * len(processed)
        for item, modality in zip(processed, modalities, strict=True):
            if modality == "image" and item.num_tokens > self.max_image_tokens:
                raise InvalidParamError(
                    "mm_processor_kwargs",
                    f"An image expands to {item.num_tokens} tokens, more than the "
                    f"{self.max_image_tokens} this server takes per image; lower "
                    "mm_processor_kwargs' max_pixels (or min_pixels).",
                )
        entries = list(zip(self.mm_hashes, processed, modalities, strict=True))
        queues = {m: iter([(h, p) for h, p, m2 in entries if m2 == m]) for m in ("image", "video")}
        modality_of = {self.image_token_id: "image", self.video_token_id: "video"}
        expanded: list[int] = []
        features: list[MultiModalFeature] = []
        for token_id in self.token_ids:
            modality = modality_of.get(token_id)
            if modality is None:
                expanded.append(token_id)
                continue
            mm_hash, item = next(queues[modality])
            placeholder = PlaceholderRange(offset=len(expanded), length=item.num_tokens)
            features.append(MultiModalFeature(mm_hash, placeholder, data=item))
            if item.token_ids is None:
                expanded.extend([token_id] * item.num_tokens)
            else:  # the image's own tokens: tile tags, newlines, image tokens (Idefics3)
                expanded.extend(item.token_ids)
        return expanded, features


class MultiModalProcessor:
    """Turns a VLM prompt's images and videos into ``MultiModalFeature``s and expands their
    placeholders.

    ``submit`` hashes each item in the calling thread (xxh3 over the encoded bytes costs far
    less than decoding), looks the hash up in the processor cache, and sends only misses to the
    preprocessing pool, each distinct item once even while it is in flight. Finished items
    enter the cache as soon as the pool returns them. Thread-safe; owns the pool: call
    ``shutdown()`` when done.
    """

    def __init__(self, model_config: ModelConfig, mm_config: MultiModalConfig) -> None:
        self.hf_config = model_config.hf_config
        self.image_token_id = model_config.image_token_id
        self.video_token_id = model_config.video_token_id
        self.max_image_tokens = mm_config.max_image_tokens
        self.max_pixels_per_request = mm_config.max_pixels_per_request
        self.processor = get_image_processor(
            model_config.path,
            model_config.hf_config,
            mm_config.processor_max_pixels,
            mm_config.mm_processor_kwargs,
        )
        self.hasher = MultiModalHasher(model_config.model, self.processor.hash_kwargs())
        self.video_processor: VideoProcessor | None = None
        if self.video_token_id is not None:
            try:
                self.video_processor = get_video_processor(
                    model_config.path, model_config.hf_config, mm_config.mm_processor_kwargs
                )
            except FileNotFoundError as e:  # images still served; a video is a 400
                logger.warning("%s Videos will be refused.", e)
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
        videos: list[Any] | None = None,
        video_uuids: list[str | None] | None = None,
    ) -> PendingImages:
        """Start preprocessing a prompt's images and videos; returns at once.

        ``uuids[i]`` (``video_uuids[i]``), when not None, identifies image (video) i in place
        of its content (vLLM's ``multi_modal_uuids``): equal uuids share cache entries whatever
        the bytes. ``mm_processor_kwargs`` (``ImageProcessor.with_kwargs``,
        ``VideoProcessor.with_kwargs``: each takes its own keys) apply to every item on top of
        the server's; ``details[i]`` is image i's ``IMAGE_DETAILS`` value or None. A video is
        encoded bytes, a path, or frames (``video_io.as_video_source``).

        Raises:
            ValueError: the prompt's placeholders and the items (or the uuids, or the
                details) differ in number, a uuid is not a str, a detail is unknown, an item
                is of an unsupported type or a missing file, or videos for a model without.
            InvalidParamError: ``mm_processor_kwargs`` the processors do not take.
        """
        kwargs = mm_processor_kwargs or {}
        # Hash all first: a bad item then queues nothing.
        jobs = self._image_jobs(token_ids, images, uuids, kwargs, details)
        num_images = len(jobs)
        jobs += self._video_jobs(token_ids, videos or [], video_uuids, kwargs)
        group = object()  # the prompt's items take turns with other prompts' in the pool
        items = [self._lookup_or_submit(mm_hash, start, group) for mm_hash, start in jobs]
        return PendingImages(
            self.image_token_id,
            token_ids,
            [mm_hash for mm_hash, _ in jobs],
            items,
            self.max_image_tokens,
            ["image"] * num_images + ["video"] * (len(jobs) - num_images),
            self.video_token_id,
        )

    def _image_jobs(
        self,
        token_ids: list[int],
        images: list[Any],
        uuids: list[str | None] | None,
        kwargs: dict[str, Any],
        details: list[str | None] | None,
    ) -> list[tuple[str, Callable[[object], Future[PreprocessResult]]]]:
        """(mm_hash, what queues it in the pool given its group) of each image; see
        ``submit``."""
        uuids = _checked(token_ids, self.image_token_id, images, uuids, "image")
        self._check_pixel_budget(images)
        details = [None] * len(images) if details is None else list(details)
        if len(details) != len(images):
            raise ValueError(f"Got {len(details)} image details for {len(images)} images.")
        kwargs = image_kwargs(kwargs, self.hf_config)  # without the video processor's own
        variants = {d: self._variant(kwargs, d, len(images)) for d in set(details)}
        return [
            (
                variants[detail][1].hash_image(image, uuid),
                functools.partial(self._start_image, image, variants[detail][0]),
            )
            for image, uuid, detail in zip(images, uuids, details, strict=True)
        ]

    def _check_pixel_budget(self, images: list[Any]) -> None:
        """Raises InvalidParamError (``messages``) when the images' declared pixels add up to
        more than ``max_pixels_per_request``: one request must not hold the pool for long."""
        total = sum(map(declared_pixels, images))
        if total > self.max_pixels_per_request:
            raise InvalidParamError(
                "messages",
                f"The request's {len(images)} images have {total} pixels together, above the "
                f"limit of {self.max_pixels_per_request} per request (max_pixels_per_request).",
            )

    def _start_image(self, image: Any, processor: ImageProcessor | None, group: object) -> Future:
        """The pool's future of ``image`` preprocessed by ``processor`` (None: the server's),
        in ``group``'s turn; a decoded image whose preprocessing only copies its pixels
        (``ImageProcessor.copies_only``) is preprocessed here instead, its future done."""
        own = processor or self.processor
        if not (isinstance(image, Image.Image) and own.copies_only(image)):
            return self.pool.submit(image, processor, group)
        future: Future[PreprocessResult] = Future()
        try:
            future.set_result(preprocess_image(image, own, self.pool.max_pixels))
        except Exception as e:  # as the pool's future would hold it
            future.set_exception(e)
        return future

    def _video_jobs(
        self,
        token_ids: list[int],
        videos: list[Any],
        uuids: list[str | None] | None,
        kwargs: dict[str, Any],
    ) -> list[tuple[str, Callable[[object], Future[PreprocessResult]]]]:
        """(mm_hash, what queues it in the pool given its group) of each video; see
        ``submit``."""
        if self.video_processor is None:
            if videos:
                raise ValueError("This model takes no videos.")
            return []
        uuids = _checked(token_ids, self.video_token_id, videos, uuids, "video")
        try:
            processor = self.video_processor.with_kwargs(video_kwargs(kwargs, self.video_processor))
        except ValueError as e:
            raise InvalidParamError("mm_processor_kwargs", str(e)) from e
        hasher = MultiModalHasher(
            self.hasher.model_id, processor.hash_kwargs(), seed=self.hasher.seed
        )
        sources = [as_video_source(video) for video in videos]
        return [
            (
                hasher.hash_video(source, uuid),
                functools.partial(self.pool.submit_video, source, processor),
            )
            for source, uuid in zip(sources, uuids, strict=True)
        ]

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
        self, mm_hash: str, start: Callable[[object], Future[PreprocessResult]], group: object
    ) -> ProcessedImage | Future[PreprocessResult]:
        """The cached item of ``mm_hash``, else its future in the pool (``start(group)``
        queues it unless it is in flight already)."""
        with self._lock:
            item = self.cache.get(mm_hash)
            if item is not None:
                return item
            future = self._in_flight.get(mm_hash)
            if future is not None:
                return future
            future = start(group)
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


def _checked(
    token_ids: list[int],
    token_id: int | None,
    items: list[Any],
    uuids: list[str | None] | None,
    modality: str,
) -> list[str | None]:
    """``uuids`` (None: one None per item) once the prompt's ``token_id`` placeholders match
    ``items`` in number and the uuids are one str or None per item; else ValueError."""
    num_placeholders = token_ids.count(token_id)
    if num_placeholders != len(items):
        raise ValueError(
            f"The prompt has {num_placeholders} {modality} placeholders but {len(items)} "
            f"{modality}s were given; each {modality} needs exactly one placeholder."
        )
    uuids = [None] * len(items) if uuids is None else list(uuids)
    if len(uuids) != len(items):
        raise ValueError(f"Got {len(uuids)} {modality} uuids for {len(items)} {modality}s.")
    if not all(uuid is None or isinstance(uuid, str) for uuid in uuids):
        raise ValueError(f"{modality.capitalize()} uuids must be strings or None.")
    return uuids
