"""The interface every vision family implements: pixels in, embeddings out.

An image goes through two steps owned by its family:

1. ``ImageProcessor.preprocess(image) -> ProcessedImage`` (CPU, in the preprocessing pool):
   the pixel tensor exactly as the checkpoint's HF processor makes it, and the number of
   placeholder tokens the image expands to in the prompt.
2. The model's ``embed_images(list[ProcessedImage]) -> list[Tensor]`` (on the device): one
   ``[num_tokens, lm_hidden]`` tensor per image, in prompt order, ready to replace the
   placeholder tokens' embeddings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image


@dataclass
class ProcessedImage:
    """One preprocessed image.

    ``pixel_values`` is family-specific:
      - Qwen2-VL / Qwen2.5-VL: ``[grid_t * grid_h * grid_w, C * temporal_patch * patch * patch]``
        patches (HF's flattened layout), with ``image_grid_thw = (t, h, w)`` in patches.
      - CLIP / LLaVA: ``[3, H, W]`` float32, resized, cropped and normalised.
      - Idefics3 / SmolVLM: ``[num_tiles, 3, tile, tile]`` float32 (tiles, then the global
        image), with ``token_ids`` its prompt tokens (tile tags, newlines and image tokens).
      - InternVL3: ``[num_tiles, 3, tile, tile]`` float32 (tiles, then the thumbnail), with
        ``token_ids`` its prompt tokens (``<img>``, the image tokens, ``</img>``).
      - LLaVA-OneVision: ``[num_tiles, 3, tile, tile]`` (the base tile, then the anyres grid),
        with ``image_size`` the original ``(height, width)``.
      - A Qwen2-VL / Qwen2.5-VL video (``modality == "video"``): the same patches with
        ``grid_t`` temporal patches of ``temporal_patch`` frames each, or uint8 frames
        ``[T, C, H, W]`` (see below); ``second_per_grid_t`` is the time one temporal patch
        spans, in seconds (Qwen2.5-VL's ``second_per_grid_ts``, for its M-RoPE time positions).
        A Qwen3-VL video: the same, with ``token_ids`` its prompt tokens (each temporal patch's
        time text, vision start, video tokens, vision end).

    Float32 pixels are final. uint8 pixels (``preprocess(..., defer_normalization=True)``) are
    resized but not yet normalised: the consumer computes ``(x - pixel_mean[c]) / pixel_std[c]``
    per channel ``c`` in float32 on the device, the same operations as on the CPU, so that a
    quarter of the bytes cross processes and the host-to-device copy. Qwen2-VL's uint8 form is
    the resized image ``[C, H, W]``, patchified on the device (an eighth of the bytes), and a
    video's the resized frames ``[T, C, H, W]`` (``T`` not yet padded to a whole temporal patch).
    """

    pixel_values: torch.Tensor
    num_tokens: int  # placeholder tokens in the prompt = rows of the image's embeddings
    image_grid_thw: tuple[int, int, int] | None = None
    pixel_mean: tuple[float, ...] = ()  # per channel, in 0..255 pixel units (uint8 pixels only)
    pixel_std: tuple[float, ...] = ()
    # The placeholder's prompt tokens (``num_tokens`` of them) where they are not all the image
    # token (Idefics3: tile tags and newlines among them); None: ``num_tokens`` image tokens.
    # The model's ``embed_images`` gives a row for every one of them.
    token_ids: tuple[int, ...] | None = None
    # The image's ``(height, width)`` in pixels before preprocessing, where the model needs it
    # (LLaVA-OneVision unpads its anyres features by it); None elsewhere.
    image_size: tuple[int, int] | None = None
    # "image" or "video": which placeholder token (the model's image or video token) it fills.
    modality: str = "image"
    second_per_grid_t: float | None = None  # videos: seconds per temporal patch


class ImageProcessor:
    """Base of each family's processor, built from the checkpoint's image processor settings
    (``processors.read_image_processor_config``).

    Raises (from ``preprocess``):
        ValueError: for an image the family cannot take (e.g. above ``max_pixels`` when the
            processor was told to reject rather than resize, or a zero-sized image).
    """

    def preprocess(self, image: Image.Image, defer_normalization: bool = False) -> ProcessedImage:
        """``defer_normalization``: return uint8 pixels where the family supports it."""
        raise NotImplementedError

    @property
    def max_num_tokens(self) -> int:
        """The most placeholder tokens one image can expand to (sizes the encoder cache)."""
        raise NotImplementedError

    def copies_only(self, image: Image.Image) -> bool:
        """Whether ``preprocess(image, defer_normalization=True)`` only copies the decoded
        ``image``'s pixels (no resize, no colour conversion): then the calling thread does it
        for less than the preprocessing pool's round trip, which pickles and pipes the pixels
        both ways. False unless the family says so."""
        return False

    def with_kwargs(self, kwargs: Mapping[str, Any]) -> ImageProcessor:
        """This processor with vLLM's ``mm_processor_kwargs`` applied (the family's keys, e.g.
        Qwen2-VL's ``min_pixels``/``max_pixels``); ``self`` for an empty mapping.

        Raises:
            ValueError: a key the family does not take (here: any), or an invalid value.
        """
        if kwargs:
            raise ValueError(
                f"Unknown mm_processor_kwargs {sorted(kwargs)}: this model's image processor "
                "takes none."
            )
        return self

    def for_prompt(self, num_images: int) -> ImageProcessor:
        """This processor for an image of a prompt of ``num_images`` images: ``self`` unless
        the family preprocesses images otherwise when a prompt has several (LLaVA-OneVision:
        one tile each, not anyres tiles, as HF's processor does)."""
        return self

    def low_detail(self) -> ImageProcessor:
        """This processor for an ``image_url`` part with ``detail: "low"``: a smaller pixel
        budget where the family resizes (fewer image tokens), else ``self``."""
        return self

    def prompt_text(self, text: str) -> str:
        """A text prompt as the family's HF processor writes it before tokenizing, its image
        placeholders left in place (Gemma 3 frames them with newlines); ``text`` as is."""
        return text

    def hash_kwargs(self) -> dict[str, str]:
        """Every setting that changes ``preprocess``'s result, for the image content hash."""
        return {name: repr(value) for name, value in sorted(vars(self).items())}
