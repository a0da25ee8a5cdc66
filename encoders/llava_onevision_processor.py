"""LLaVA-OneVision image processor: anyres tiles of one image, and how many tokens it takes.

Pixels equal transformers' ``LlavaOnevisionImageProcessor`` (torchvision backend). An image
alone in its prompt (``anyres``): convert to RGB; choose the best of ``image_grid_pinpoints``
for its size (``anyres.select_best_resolution``); resize it (bicubic) to fit that resolution
with its aspect ratio and zero-pad it there, centred; cut it into tiles in raster order, after
the whole image resized to one tile (the base tile); rescale and normalise. An image among
several in one prompt is instead padded to a square with the mean colour and resized to one
tile, as HF's processor does for a prompt of several images (``for_prompt``).

The image's placeholder is ``num_tokens`` image tokens, which the model fills with the base
tile's features, then the unpadded (and maybe downsampled) feature map row by row, each row
ending with ``image_newline`` (``anyres.AnyresLayout``); HF's ``LlavaOnevisionProcessor``
counts them so from the image's original size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from mm_serve.encoders.anyres import (
    anyres_layout,
    check_pinpoints,
    fitted_size,
    max_anyres_tokens,
    select_best_resolution,
)
from mm_serve.encoders.base import ImageProcessor, ProcessedImage
from mm_serve.encoders.image_io import Normalization, pil_to_tensor, resize, split_tiles


def paste(pixels: torch.Tensor, height: int, width: int, fill: tuple[int, ...]) -> torch.Tensor:
    """uint8 ``[C, h, w]`` centred on a ``[C, height, width]`` canvas of colour ``fill`` (the
    odd pixel of a margin after the image), as ``torchvision``'s ``pad`` in HF's processor."""
    channels, h, w = pixels.shape
    canvas = torch.tensor(fill, dtype=pixels.dtype).view(-1, 1, 1).expand(channels, height, width)
    canvas = canvas.clone()
    top, left = (height - h) // 2, (width - w) // 2
    canvas[:, top : top + h, left : left + w] = pixels
    return canvas


@dataclass(kw_only=True, eq=False)
class LlavaOnevisionImageProcessor(ImageProcessor):
    """``preprocess`` gives ``[num_tiles, 3, tile, tile]`` (the base tile, then the grid in
    raster order; one tile unless ``anyres``) and ``image_size``, the image's original
    ``(height, width)``, which the model needs to unpad its features.

    ``side``: features per tile side (the tower's ``image_size // patch_size``);
    ``max_tiles``: ``N`` of the config's ``vision_aspect_ratio = "anyres_max_N"``.
    """

    pinpoints: tuple[tuple[int, int], ...]
    tile: int
    side: int
    max_tiles: int
    anyres: bool = True  # False: one of several images of a prompt (HF's batch_num_images > 1)
    do_resize: bool = True
    resample: int = 3
    normalization: Normalization = field(default_factory=Normalization)
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        check_pinpoints(self.pinpoints, self.tile)

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], tile: int, side: int, max_tiles: int
    ) -> LlavaOnevisionImageProcessor:
        """From image processor settings; ``tile`` is the tower's ``image_size``.

        Raises:
            ValueError: a ``size`` (or ``crop_size``) other than ``tile x tile``, center
                cropping, or pinpoints that are not whole tiles.
        """
        size = dict(config.get("size") or {"height": tile, "width": tile})
        sides = {size.get("height"), size.get("width")} - {None} or {size.get("shortest_edge")}
        crop = dict(config.get("crop_size") or {}).get("height", tile)
        if sides != {tile} or crop != tile or config.get("do_center_crop"):
            raise ValueError(
                f"LLaVA-OneVision tiles must be {tile} x {tile} pixels (the tower's image_size) "
                f"without center cropping; got size {size}, crop_size {config.get('crop_size')}."
            )
        return cls(
            pinpoints=tuple(tuple(int(v) for v in p) for p in config["image_grid_pinpoints"]),
            tile=tile,
            side=side,
            max_tiles=max_tiles,
            do_resize=bool(config.get("do_resize", True)),
            resample=int(config.get("resample", 3)),
            normalization=Normalization.from_config(config),
            do_convert_rgb=bool(config.get("do_convert_rgb", True)),
        )

    def for_prompt(self, num_images: int) -> LlavaOnevisionImageProcessor:
        """Anyres tiles for an image alone in its prompt, one padded tile for several."""
        anyres = num_images == 1
        return self if anyres == self.anyres else dataclasses.replace(self, anyres=anyres)

    def num_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens of an image of ``height x width`` pixels."""
        if not self.anyres:
            return self.side**2 + 1
        layout = anyres_layout(height, width, self.pinpoints, self.tile, self.side, self.max_tiles)
        return layout.num_tokens

    @property
    def max_num_tokens(self) -> int:
        if not self.anyres:
            return self.side**2 + 1
        return max_anyres_tokens(self.pinpoints, self.tile, self.side, self.max_tiles)

    def tiles(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 ``[3, H, W]`` -> uint8 ``[num_tiles, 3, tile, tile]`` (``num_tiles`` is 1
        without ``anyres``, else ``1 + rows * cols``)."""
        t = self.tile
        height, width = pixels.shape[-2:]
        if not self.anyres:
            side = max(height, width)
            fill = tuple(int(x * 255) for x in self.normalization.image_mean)
            square = paste(pixels, side, side, fill) if height != width else pixels
            return (resize(square, t, t, self.resample) if self.do_resize else square)[None]
        best = select_best_resolution(height, width, self.pinpoints)
        fitted = resize(pixels, *fitted_size(height, width, best), self.resample)
        padded = paste(fitted, *best, fill=(0,) * pixels.shape[0])
        base = resize(pixels, t, t, self.resample)
        # The tiles are t x t already: the final resize keeps them.
        return torch.cat([base[None], split_tiles(padded, t, t)])

    def preprocess(self, image: Image.Image, defer_normalization: bool = False) -> ProcessedImage:
        """PIL image (any mode) -> ``[num_tiles, 3, tile, tile]``: float32, or with
        ``defer_normalization`` (and a normalising config) uint8 with the folded mean and std.

        Raises:
            ValueError: zero-sized image.
        """
        pixels = pil_to_tensor(image, self.do_convert_rgb)  # [3, H, W] uint8
        height, width = pixels.shape[-2:]
        return ProcessedImage(
            **self.normalization.tile_fields(self.tiles(pixels), defer_normalization),
            num_tokens=self.num_tokens(height, width),
            image_size=(int(height), int(width)),
        )
