"""CLIP image processor (LLaVA and other fixed-resolution CLIP/SigLIP towers).

Resize (shortest edge, bicubic) → center crop → rescale → normalise, giving one fixed-size
``[3, crop_h, crop_w]`` image. Pixels equal those of transformers' default
``CLIPImageProcessor`` (torchvision backend).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image

from mm_serve.encoders.base import ImageProcessor, ProcessedImage
from mm_serve.encoders.image_io import Normalization, pil_to_tensor, resize


def shortest_edge_size(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """``(height, width)`` with the short side at ``shortest_edge``, the long one scaled and
    truncated, as HF's ``get_resize_output_image_size(default_to_square=False)``."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = shortest_edge, int(shortest_edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def center_crop(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``[C, H, W]`` → ``[C, height, width]`` around the centre, as HF's torchvision backend.

    A side shorter than the crop is first zero-padded on both sides (the extra pixel of an
    odd difference goes after). The crop offset truncates ``(H - height) / 2``, which
    differs from ``torchvision``'s ``center_crop`` (it rounds).
    """
    in_height, in_width = pixels.shape[-2:]
    pad_h, pad_w = max(height - in_height, 0), max(width - in_width, 0)
    if pad_h or pad_w:
        pixels = F.pad(pixels, (pad_w // 2, (pad_w + 1) // 2, pad_h // 2, (pad_h + 1) // 2))
        in_height, in_width = pixels.shape[-2:]
    top = int((in_height - height) / 2.0)
    left = int((in_width - width) / 2.0)
    return pixels[..., top : top + height, left : left + width]


def _size_dict(value: Any, square: bool) -> dict[str, int]:
    """HF's ``get_size_dict``: an int means a shortest edge (size) or a square (crop_size)."""
    if isinstance(value, int):
        return {"height": value, "width": value} if square else {"shortest_edge": value}
    return {key: int(v) for key, v in dict(value).items() if v is not None}


@dataclass(kw_only=True, eq=False)
class CLIPImageProcessor(ImageProcessor):
    """Fixed-resolution processor; ``preprocess`` gives ``[3, crop_h, crop_w]`` float32.

    ``num_tokens`` (placeholder tokens per image) depends on the model, not on the pixels:
    the caller computes it from the model config (LLaVA: ``(image_size // patch_size) ** 2``,
    plus one for the CLS token with ``vision_feature_select_strategy == "full"``).
    """

    num_tokens: int
    size: Mapping[str, int] | None = None  # default {"shortest_edge": 224}
    crop_size: Mapping[str, int] | None = None  # default 224 x 224
    do_resize: bool = True
    do_center_crop: bool = True
    resample: int = 3
    normalization: Normalization = field(default_factory=Normalization)
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        self.size = dict(self.size or {"shortest_edge": 224})
        self.crop_size = dict(self.crop_size or {"height": 224, "width": 224})
        keys = self.size.keys()
        supported = "longest_edge" not in keys and (
            "shortest_edge" in keys or {"height", "width"} <= keys
        )
        if self.do_resize and not supported:
            raise ValueError(
                f"Unsupported size {self.size}: expected 'shortest_edge' (without "
                "'longest_edge'), or 'height' and 'width'."
            )
        if self.do_center_crop and not {"height", "width"} <= self.crop_size.keys():
            raise ValueError(f"crop_size must have 'height' and 'width', got {self.crop_size}.")

    @classmethod
    def from_config(cls, config: Mapping[str, Any], num_tokens: int) -> CLIPImageProcessor:
        """From image processor settings (``size``/``crop_size`` as dicts or ints)."""
        return cls(
            num_tokens=num_tokens,
            size=_size_dict(config.get("size", 224), square=False),
            crop_size=_size_dict(config.get("crop_size", 224), square=True),
            do_resize=bool(config.get("do_resize", True)),
            do_center_crop=bool(config.get("do_center_crop", True)),
            resample=int(config.get("resample", 3)),
            normalization=Normalization.from_config(config),
            do_convert_rgb=bool(config.get("do_convert_rgb", True)),
        )

    @property
    def max_num_tokens(self) -> int:
        return self.num_tokens

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """The resized ``(height, width)`` of a ``height x width`` image, before the crop."""
        if not self.do_resize:
            return height, width
        if "shortest_edge" in self.size:
            return shortest_edge_size(height, width, self.size["shortest_edge"])
        return self.size["height"], self.size["width"]

    def preprocess(self, image: Image.Image, defer_normalization: bool = False) -> ProcessedImage:
        """PIL image (any mode) → ``[3, crop_h, crop_w]`` float32 (``[3, H, W]`` uncropped);
        always normalised (``defer_normalization`` is not supported here).

        Raises:
            ValueError: zero-sized image.
        """
        pixels = pil_to_tensor(image, self.do_convert_rgb)  # [3, H, W] uint8
        if self.do_resize:
            pixels = resize(pixels, *self.target_size(*pixels.shape[-2:]), self.resample)
        if self.do_center_crop:
            pixels = center_crop(pixels, self.crop_size["height"], self.crop_size["width"])
        pixel_values = self.normalization(pixels).contiguous()
        return ProcessedImage(pixel_values=pixel_values, num_tokens=self.num_tokens)
