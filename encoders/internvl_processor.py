"""InternVL3 image processor: dynamic tiling of one image, and the prompt tokens it takes.

Pixels equal transformers' ``GotOcr2ImageProcessor`` (torchvision backend) as
``InternVLProcessor`` calls it (``crop_to_patches`` on): RGB; the ``cols x rows`` grid of
``min_patches`` to ``max_patches`` tiles closest to the image's aspect ratio (``tile_grid``);
resize (bicubic, antialiased) and cut into tiles in raster order; the thumbnail after more than
one tile; rescale and normalise (ImageNet statistics). Without ``crop_to_patches``: one tile.

Prompt tokens: ``<img>`` + ``image_seq_len`` image tokens per tile + ``</img>``, one placeholder
(one ``mm_hash``) that a chunk may cut anywhere."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from mm_serve.checkpoint.families import config_get
from mm_serve.encoders.base import ImageProcessor, ProcessedImage
from mm_serve.encoders.image_io import Normalization, pil_to_tensor, resize, split_tiles

# The tokenizer's named image tokens (tokenizer_config.json), with InternVL3's values.
TOKEN_NAMES = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
}


def tile_grid(
    height: int, width: int, tile: tuple[int, int], min_tiles: int, max_tiles: int
) -> tuple[int, int]:
    """``(cols, rows)`` of the tiling of a ``height x width`` image (GotOcr2's
    ``get_optimal_tiled_canvas``, InternVL's ``dynamic_preprocess``).

    Among the grids of ``min_tiles`` to ``max_tiles`` tiles, taken by increasing tile count
    (columns-major within a count), the first whose ``cols / rows`` is closest to
    ``width / height`` wins; a later grid at exactly the same distance wins instead while the
    image's area exceeds half the grid's (``tile`` is ``(tile_h, tile_w)`` pixels). (1, 1)
    when no grid qualifies.
    """
    grids = [
        (cols, rows)
        for cols in range(1, max_tiles + 1)
        for rows in range(1, max_tiles + 1)
        if min_tiles <= cols * rows <= max_tiles
    ]
    grids.sort(key=lambda grid: grid[0] * grid[1])  # stable: columns-major within a count
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), math.inf
    for cols, rows in grids:
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * tile[0] * tile[1] * cols * rows:
            best = (cols, rows)
    return best


@dataclass(frozen=True)
class InternVLTokens:
    """The token ids of the expansion: ``start`` (``<img>``), ``context`` (the image token,
    ``<IMG_CONTEXT>``) and ``end`` (``</img>``)."""

    start: int
    context: int
    end: int

    @classmethod
    def from_tokenizer_files(cls, folder: str | Path) -> InternVLTokens:
        """From a checkpoint's ``tokenizer.json`` and the token names of its
        ``tokenizer_config.json`` (InternVL3's names where it has none).

        Raises:
            FileNotFoundError: no ``tokenizer.json``.
            ValueError: the tokenizer lacks one of the tokens.
        """
        from tokenizers import Tokenizer

        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"InternVL needs the checkpoint's {folder}/tokenizer.json.")
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_file = folder / "tokenizer_config.json"
        names = json.loads(config_file.read_text("utf-8")) if config_file.is_file() else {}
        extra = names.get("extra_special_tokens")
        names = {**names, **(extra if isinstance(extra, dict) else {})}

        def token(key: str) -> int:
            text = names.get(key) or TOKEN_NAMES[key]
            token_id = tokenizer.token_to_id(text)
            if token_id is None:
                raise ValueError(f"The tokenizer in {folder} has no {text!r} token ({key}).")
            return token_id

        return cls(
            start=token("start_image_token"),
            context=token("context_image_token"),
            end=token("end_image_token"),
        )

    def expansion(self, num_tiles: int, image_seq_len: int) -> list[int]:
        """The prompt tokens of an image of ``num_tiles`` tiles (thumbnail included)."""
        return [self.start, *[self.context] * (num_tiles * image_seq_len), self.end]


@dataclass(kw_only=True, eq=False)
class InternVLImageProcessor(ImageProcessor):
    """``preprocess`` gives ``[num_tiles, 3, tile_h, tile_w]`` float32, or uint8 when deferring
    the normalisation (the tiles in raster order, then the thumbnail), and the image's prompt
    tokens (``ProcessedImage.token_ids``)."""

    tokens: InternVLTokens
    image_seq_len: int  # image tokens per tile
    tile: tuple[int, int] = (448, 448)  # (height, width)
    crop_to_patches: bool = True
    min_patches: int = 1
    max_patches: int = 12
    resample: int = 3  # BICUBIC
    normalization: Normalization = field(default_factory=Normalization)
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.min_patches <= self.max_patches:
            raise ValueError(
                f"Need 1 <= min_patches <= max_patches, got {self.min_patches} and "
                f"{self.max_patches}."
            )

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], tokens: InternVLTokens, image_seq_len: int
    ) -> InternVLImageProcessor:
        """From image processor settings (``size`` with ``height`` and ``width``; GotOcr2's
        defaults: 384 x 384, 1 to 12 tiles, CLIP statistics). The saved ``crop_to_patches``
        (false in InternVL3's files) is not read: ``InternVLProcessor`` turns it on in every
        call.

        Raises:
            ValueError: a ``size`` without ``height`` and ``width``, or bad tile counts.
        """
        size = dict(config.get("size") or {"height": 384, "width": 384})
        if not {"height", "width"} <= size.keys():
            raise ValueError(f"InternVL's size must have 'height' and 'width', got {size}.")
        return cls(
            tokens=tokens,
            image_seq_len=image_seq_len,
            tile=(int(size["height"]), int(size["width"])),
            min_patches=int(config.get("min_patches", 1)),
            max_patches=int(config.get("max_patches", 12)),
            resample=int(config.get("resample", 3)),
            normalization=Normalization.from_config(config),
            do_convert_rgb=bool(config.get("do_convert_rgb", True)),
        )

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """``(cols, rows)`` of tiles of a ``height x width`` image; (1, 1): one tile."""
        if not self.crop_to_patches:
            return 1, 1
        return tile_grid(height, width, self.tile, self.min_patches, self.max_patches)

    def num_tiles(self, height: int, width: int) -> int:
        """Tiles of a ``height x width`` image, the thumbnail included."""
        cols, rows = self.grid(height, width)
        return cols * rows + (1 if cols * rows > 1 else 0)

    @property
    def max_num_tokens(self) -> int:
        # max_patches x 1 is always a grid (the widest): a wide enough image takes it.
        most = self.max_patches + 1 if self.crop_to_patches and self.max_patches > 1 else 1
        return len(self.tokens.expansion(most, self.image_seq_len))

    def tiles(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 ``[3, H, W]`` -> uint8 ``[num_tiles, 3, tile_h, tile_w]``."""
        th, tw = self.tile
        cols, rows = self.grid(*pixels.shape[-2:])
        if cols * rows == 1:
            return resize(pixels, th, tw, self.resample)[None]
        canvas = resize(pixels, rows * th, cols * tw, self.resample)
        thumbnail = resize(pixels, th, tw, self.resample)
        return torch.cat([split_tiles(canvas, th, tw), thumbnail[None]])

    def preprocess(self, image: Image.Image, defer_normalization: bool = False) -> ProcessedImage:
        """PIL image (any mode) -> ``[num_tiles, 3, tile_h, tile_w]``: float32, or uint8 with
        ``defer_normalization`` (``Normalization.tile_fields``).

        Raises:
            ValueError: zero-sized image.
        """
        tiles = self.tiles(pil_to_tensor(image, self.do_convert_rgb))
        token_ids = tuple(self.tokens.expansion(len(tiles), self.image_seq_len))
        return ProcessedImage(
            **self.normalization.tile_fields(tiles, defer_normalization),
            num_tokens=len(token_ids),
            token_ids=token_ids,
        )


def image_seq_len(hf_config: Any) -> int:
    """Image tokens per tile, ``(image_size / patch_size) ** 2 * downsample_ratio ** 2``, of
    an ``InternVLConfig`` or its dict form (``image_size`` and ``patch_size`` ints or pairs)."""
    vision = config_get(hf_config, "vision_config")
    image_size, patch_size = config_get(vision, "image_size"), config_get(vision, "patch_size")
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    ph, pw = (patch_size, patch_size) if isinstance(patch_size, int) else patch_size
    ratio = config_get(hf_config, "downsample_ratio", 0.5)
    return int((height // ph) * (width // pw) * ratio**2)
