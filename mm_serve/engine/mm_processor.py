"""Image prompts: load and preprocess images, expand their placeholders, hash their content.

A VLM prompt carries one image-token placeholder per image (Qwen2-VL's chat template writes
``<|vision_start|><|image_pad|><|vision_end|>``, LLaVA's ``<image>``). Each placeholder is
expanded to as many tokens as the image has embeddings, and its ``PlaceholderRange`` and
``mm_hash`` go on the request.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from mm_serve.cache.mm_hash import hash_processed_image
from mm_serve.config import ModelConfig, MultiModalConfig
from mm_serve.encoders.base import ProcessedImage
from mm_serve.encoders.image_io import load_image
from mm_serve.encoders.processors import get_image_processor
from mm_serve.request import MultiModalFeature, PlaceholderRange


def image_token_id(hf_config: Any) -> int | None:
    """The placeholder token id of a VLM config, None for a text-only model."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(hf_config, name, None)
        if value is not None:
            return value
    return None


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


class MultiModalProcessor:
    """Turns a VLM prompt's images into ``MultiModalFeature``s and expands its placeholders."""

    def __init__(self, model_config: ModelConfig, mm_config: MultiModalConfig) -> None:
        self.model_config = model_config
        self.mm_config = mm_config
        self.image_token_id = image_token_id(model_config.hf_config)
        self.image_processor = get_image_processor(
            model_config.path, model_config.hf_config, max_pixels=mm_config.processor_max_pixels
        )

    def process_image(self, source: Any) -> ProcessedImage:
        """Decode (EXIF-rotated), check the size limit, preprocess.

        Raises:
            ValueError: undecodable data, or more than ``max_pixels`` input pixels.
        """
        image = load_image(source)
        width, height = image.size
        if width * height > self.mm_config.max_pixels:
            raise ValueError(
                f"The image is {width}x{height} = {width * height} pixels, above the limit of "
                f"{self.mm_config.max_pixels} (max_pixels)."
            )
        return self.image_processor.preprocess(image)

    def expand(
        self, token_ids: list[int], images: list[Any]
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """Replace the i-th image placeholder with ``num_tokens`` copies for image i.

        Raises:
            ValueError: if the prompt's placeholders and the images differ in number.
        """
        num_placeholders = token_ids.count(self.image_token_id)
        if num_placeholders != len(images):
            raise ValueError(
                f"The prompt has {num_placeholders} image placeholders but {len(images)} "
                "images were given; each image needs exactly one placeholder."
            )
        processed = [self.process_image(image) for image in images]
        expanded: list[int] = []
        features: list[MultiModalFeature] = []
        image_iter = iter(processed)
        for token_id in token_ids:
            if token_id != self.image_token_id:
                expanded.append(token_id)
                continue
            item = next(image_iter)
            placeholder = PlaceholderRange(offset=len(expanded), length=item.num_tokens)
            mm_hash = hash_processed_image(self.model_config.model, item)
            features.append(MultiModalFeature(mm_hash, placeholder, data=item))
            expanded.extend([self.image_token_id] * item.num_tokens)
        return expanded, features


def split_chat_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list]:
    """OpenAI-style messages → (messages with ``{"type": "image"}`` parts, images in order).

    Accepts ``image_url`` parts (``{"url": data/file URL or path}``) and ``image`` parts
    (``{"image": PIL image | bytes | path}``).
    """
    images: list = []
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
                images.append(image_from_url(url["url"] if isinstance(url, dict) else url))
                parts.append({"type": "image"})
            elif kind == "image":
                images.append(part.get("image"))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        rendered.append({**message, "content": parts})
    return rendered, images
