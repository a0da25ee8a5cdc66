"""Idefics3 / SmolVLM image processor: tiles of one image, and the prompt tokens they take.

Pixels equal transformers' ``Idefics3ImageProcessor`` (torchvision backend): RGB, resize the
longest edge to ``size["longest_edge"]`` (short side scaled, truncated, made even), resize up to
multiples of the tile (``max_image_size["longest_edge"]``), cut into ``rows x cols`` tiles in
raster order, append the global image (resized to one tile), rescale and normalise. An image
that fits one tile is the global image alone.

Prompt tokens, as ``Idefics3Processor`` expands ``<image>``:

- tiled: per row, ``<fake_token_around_image><row_r_col_c>`` + ``image_seq_len`` x ``<image>``
  per tile, then ``"\n"``; the last row's newline and one more make ``"\n\n"``; then the global
  image;
- global image: ``<fake_token_around_image><global-img>`` + ``image_seq_len`` x ``<image>``
  + ``<fake_token_around_image>``.

The expansion is one placeholder (one ``mm_hash``) that a chunk may cut anywhere."""

from __future__ import annotations

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

MAX_IMAGE_SIZE = 4096  # transformers' cap on the resized longest edge
IMAGENET_STANDARD = (0.5, 0.5, 0.5)


def longest_edge_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """HF's ``get_resize_output_image_size``: the long side to ``longest_edge`` (up or down),
    the short side scaled, truncated and rounded up to even, then capped at 4096."""
    aspect = width / height
    if width >= height:
        width, height = longest_edge, int(longest_edge / aspect)
        height += height % 2
    else:
        height, width = longest_edge, int(longest_edge * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """HF's ``resize_for_vision_encoder``: both sides up to multiples of ``tile``."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


@dataclass(frozen=True)
class Idefics3Tokens:
    """The token ids of the expansion: ``newline`` and ``double_newline`` as the tokenizer
    splits ``"\\n"`` and ``"\\n\\n"`` between two special tokens; ``row_col[r][c]`` is
    ``<row_{r+1}_col_{c+1}>``."""

    image: int
    fake: int
    global_img: int
    row_col: tuple[tuple[int, ...], ...]
    newline: tuple[int, ...]
    double_newline: tuple[int, ...]

    @classmethod
    def from_tokenizer_file(cls, path: str | Path) -> Idefics3Tokens:
        """From a checkpoint's ``tokenizer.json``. Raises ``ValueError`` for a missing token."""
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path))

        def token(text: str) -> int:
            token_id = tokenizer.token_to_id(text)
            if token_id is None:
                raise ValueError(f"The tokenizer {path} has no {text!r} token.")
            return token_id

        def between_specials(text: str) -> tuple[int, ...]:
            ids = tokenizer.encode(f"<image>{text}<image>", add_special_tokens=False).ids
            return tuple(ids[1:-1])

        return cls(
            image=token("<image>"),
            fake=token("<fake_token_around_image>"),
            global_img=token("<global-img>"),
            row_col=tuple(
                tuple(token(f"<row_{r}_col_{c}>") for c in range(1, 7)) for r in range(1, 7)
            ),
            newline=between_specials("\n"),
            double_newline=between_specials("\n\n"),
        )

    def expansion(self, rows: int, cols: int, image_seq_len: int) -> list[int]:
        """The prompt tokens of an image of ``rows x cols`` tiles (0 x 0: global image only)."""
        images = [self.image] * image_seq_len
        tokens: list[int] = []
        for r in range(rows):
            for c in range(cols):
                tokens += [self.fake, self.row_col[r][c], *images]
            if r < rows - 1:
                tokens += self.newline
        if rows:
            tokens += self.double_newline
        return tokens + [self.fake, self.global_img, *images, self.fake]


@dataclass(kw_only=True, eq=False)
class Idefics3ImageProcessor(ImageProcessor):
    """``preprocess`` gives ``[num_tiles, 3, tile, tile]`` float32 (the tiles in raster order,
    then the global image) and the image's prompt tokens (``ProcessedImage.token_ids``)."""

    tokens: Idefics3Tokens
    image_seq_len: int  # image tokens per tile
    longest_edge: int = 4 * 364
    tile: int = 364
    do_resize: bool = True
    do_image_splitting: bool = True
    resample: int = 1  # LANCZOS
    normalization: Normalization = field(default_factory=Normalization)
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        side = self.max_grid_side()
        if side > len(self.tokens.row_col):
            raise ValueError(
                f"size longest_edge {self.longest_edge} makes up to {side} tiles of "
                f"{self.tile} per side; the tokenizer has <row_r_col_c> tags for "
                f"{len(self.tokens.row_col)}."
            )

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], tokens: Idefics3Tokens, image_seq_len: int
    ) -> Idefics3ImageProcessor:
        """From image processor settings (``size`` and ``max_image_size`` with
        ``longest_edge``; ImageNet-standard mean and std by default)."""
        defaults = {"image_mean": IMAGENET_STANDARD, "image_std": IMAGENET_STANDARD}
        return cls(
            tokens=tokens,
            image_seq_len=image_seq_len,
            longest_edge=int(dict(config.get("size") or {}).get("longest_edge", 4 * 364)),
            tile=int(dict(config.get("max_image_size") or {}).get("longest_edge", 364)),
            do_resize=bool(config.get("do_resize", True)),
            do_image_splitting=bool(config.get("do_image_splitting", True)),
            resample=int(config.get("resample", 1)),
            normalization=Normalization.from_config({**defaults, **config}),
            do_convert_rgb=bool(config.get("do_convert_rgb", True)),
        )

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """``(rows, cols)`` of tiles of a ``height x width`` image, ``(0, 0)`` for one tile."""
        if not self.do_image_splitting:
            return 0, 0
        if self.do_resize:
            height, width = longest_edge_size(height, width, self.longest_edge)
        height, width = tile_multiple_size(height, width, self.tile)
        if height > self.tile or width > self.tile:
            return math.ceil(height / self.tile), math.ceil(width / self.tile)
        return 0, 0

    def num_tokens(self, rows: int, cols: int) -> int:
        return len(self.tokens.expansion(rows, cols, self.image_seq_len))

    def max_grid_side(self) -> int:
        """The most tiles per side of any image (1: never split)."""
        if not self.do_image_splitting:
            return 1
        # The short side is made even: an odd longest edge may become one pixel longer.
        bound = self.longest_edge + self.longest_edge % 2 if self.do_resize else MAX_IMAGE_SIZE
        return math.ceil(bound / self.tile)

    @property
    def max_num_tokens(self) -> int:
        n = self.max_grid_side()
        return self.num_tokens(n, n) if n > 1 else self.num_tokens(0, 0)

    def tiles(self, pixels: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """uint8 ``[3, H, W]`` -> (uint8 ``[num_tiles, 3, tile, tile]``, rows, cols)."""
        t = self.tile
        if self.do_resize:
            pixels = resize(
                pixels, *longest_edge_size(*pixels.shape[-2:], self.longest_edge), self.resample
            )
        if not self.do_image_splitting:
            return resize(pixels, t, t, self.resample)[None], 0, 0
        pixels = resize(pixels, *tile_multiple_size(*pixels.shape[-2:], t), self.resample)
        height, width = pixels.shape[-2:]
        if height <= t and width <= t:
            return pixels[None], 0, 0
        whole = resize(pixels, t, t, self.resample)
        return torch.cat([split_tiles(pixels, t, t), whole[None]]), height // t, width // t

    def preprocess(self, image: Image.Image, defer_normalization: bool = False) -> ProcessedImage:
        """PIL image (any mode) -> ``[num_tiles, 3, tile, tile]``: float32, or uint8 with
        ``defer_normalization`` (``Normalization.tile_fields``).

        Raises:
            ValueError: zero-sized image.
        """
        tiles, rows, cols = self.tiles(pil_to_tensor(image, self.do_convert_rgb))
        token_ids = tuple(self.tokens.expansion(rows, cols, self.image_seq_len))
        return ProcessedImage(
            **self.normalization.tile_fields(tiles, defer_normalization),
            num_tokens=len(token_ids),
            token_ids=token_ids,
        )


def image_seq_len(hf_config: Any) -> int:
    """Image tokens per tile: ``(image_size // patch_size) ** 2 / scale_factor ** 2``, of an
    ``Idefics3Config`` or its dict form."""
    vision = config_get(hf_config, "vision_config")
    size = config_get(vision, "image_size") // config_get(vision, "patch_size")
    return int(size**2 / config_get(hf_config, "scale_factor") ** 2)
