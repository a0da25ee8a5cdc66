"""Decoding images and the pixel steps every family's processor shares.

Each step reproduces what transformers' default (torchvision-backend) image processors do, so
that our pixels equal theirs: ``to_rgb`` is ``image_transforms.convert_to_rgb``,
``pil_to_tensor`` is ``TorchvisionBackend.process_image`` on a PIL image, ``resize`` calls the
same ``torchvision.transforms.v2.functional.resize``, and ``Normalization`` folds the rescale
into mean/std exactly as ``TorchvisionBackend.rescale_and_normalize`` does.
"""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

# OpenAI CLIP statistics: the default of both CLIP and Qwen2-VL processors.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

logger = logging.getLogger(__name__)

_EXIF_ORIENTATION = 0x0112

ImageSource = bytes | bytearray | memoryview | str | Path | Image.Image


def load_image(source: ImageSource, max_pixels: int | None = None) -> Image.Image:
    """Decode an image and apply its EXIF orientation (as HF's ``load_image`` does).

    ``source``: encoded bytes (any format Pillow reads), a file path, or a PIL image (decoded
    already; only its EXIF orientation is applied). The mode is left as decoded: call
    ``to_rgb`` (or a processor) next. Animated images give their first frame. With
    ``max_pixels``, the size declared in the header is checked before any pixel is decoded, so
    a small file declaring a huge image costs nothing.

    Raises:
        ValueError: empty or undecodable data, a missing file, a zero-sized image, an image
            above ``max_pixels`` or Pillow's decompression-bomb limit, or a source of another
            type.
    """
    if isinstance(source, Image.Image):
        image = source
        check_max_pixels(image, max_pixels)
    elif isinstance(source, (bytes, bytearray, memoryview)):
        image = _decode(bytes(source), "the image data", max_pixels)
    elif isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"Image file not found: {str(path)!r}.")
        image = _decode(path.read_bytes(), f"the image file {str(path)!r}", max_pixels)
    else:
        raise ValueError(
            f"Cannot load an image from a {type(source).__name__}; pass bytes, a path or a "
            "PIL image."
        )
    image = _apply_exif_orientation(image)
    check_image_size(image)
    return image


def declared_pixels(source: ImageSource) -> int:
    """Width x height as the source's header declares it (a PIL image: its size), read
    without decoding a pixel; 0 when the header cannot be read (decoding reports why)."""
    if isinstance(source, Image.Image):
        return source.width * source.height
    try:
        if isinstance(source, (bytes, bytearray, memoryview)):
            source = io.BytesIO(source)
        elif not isinstance(source, (str, Path)):
            return 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(source) as image:  # reads the header only
                return image.width * image.height
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return 0


def _apply_exif_orientation(image: Image.Image) -> Image.Image:
    """The image as a viewer shows it; unchanged (no copy) when there is nothing to do."""
    try:
        if image.getexif().get(_EXIF_ORIENTATION, 1) in (1, None):
            return image
        return ImageOps.exif_transpose(image)
    except (ValueError, OSError, SyntaxError, TypeError, KeyError) as e:
        # Malformed EXIF: show the pixels as stored, as browsers do, rather than reject.
        logger.debug("ignoring unreadable EXIF orientation: %s", e)
        return image


def _decode(data: bytes, what: str, max_pixels: int | None) -> Image.Image:
    if not data:
        raise ValueError(f"Cannot decode {what}: it is empty.")
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError as e:
        raise _too_many_pixels(what, max_pixels, e) from e
    except UnidentifiedImageError as e:
        raise ValueError(f"Cannot decode {what}: not an image in a known format.") from e
    except (OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"Cannot decode {what} as an image: {e}") from e
    check_max_pixels(image, max_pixels)
    try:
        image.load()  # decode now: truncated or corrupt data fails here, not later
    except Image.DecompressionBombError as e:
        raise _too_many_pixels(what, max_pixels, e) from e
    except (OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"Cannot decode {what} as an image: {e}") from e
    return image


def _too_many_pixels(what: str, max_pixels: int | None, error: Exception) -> ValueError:
    """Pillow's decompression-bomb refusal, told as our ``max_pixels`` limit where that one is
    the lower (Pillow refuses above twice ``Image.MAX_IMAGE_PIXELS``)."""
    if max_pixels is None or max_pixels >= 2 * (Image.MAX_IMAGE_PIXELS or 0):
        return ValueError(f"Refusing to decode {what}: {error}")
    return ValueError(
        f"Refusing to decode {what}: it declares more pixels than the limit of {max_pixels} "
        "(max_pixels)."
    )


def check_max_pixels(image: Image.Image, max_pixels: int | None) -> None:
    """Raises ValueError when the image has more than ``max_pixels`` pixels (None: no limit)."""
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        raise ValueError(
            f"The image is {width}x{height} = {width * height} pixels, above the limit of "
            f"{max_pixels} (max_pixels)."
        )


def check_image_size(image: Image.Image) -> None:
    """Raises ValueError for an image with zero width or height."""
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ValueError(f"The image is {width}x{height} pixels: it has no pixels to process.")


def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode → RGB, as transformers' ``convert_to_rgb`` does.

    Transparency (an alpha band as in RGBA/LA/PA, or a ``transparency`` entry as in palette
    or colour-keyed images) is composited onto white; every other mode (L, P, CMYK, I;16,
    YCbCr, 1, ...) goes through Pillow's ``convert("RGB")``. This is transformers 5.23's
    behaviour (and vLLM's); earlier releases (4.x, 5.17) drop alpha without compositing, so
    their pixels differ from ours where a transparent pixel stores a non-white colour.

    Raises:
        ValueError: a mode Pillow cannot convert to RGB.
    """
    try:
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return image.convert("RGB")
    except (ValueError, OSError) as e:
        raise ValueError(f"Cannot convert an image of mode {image.mode!r} to RGB: {e}") from e


def pil_to_tensor(image: Image.Image, do_convert_rgb: bool = True) -> torch.Tensor:
    """PIL image → ``[3, H, W]`` uint8 tensor (RGB when ``do_convert_rgb``).

    Raises:
        ValueError: zero-sized image; a non-RGB image when ``do_convert_rgb`` is off.
    """
    check_image_size(image)
    if do_convert_rgb:
        image = to_rgb(image)
    elif image.mode != "RGB":
        raise ValueError(f"Expected an RGB image (do_convert_rgb is off), got mode {image.mode!r}.")
    # Pillow's channel planes, stacked: no strided copy, and no parallel region of torch's
    # thread pool (the front end runs this with every core's thread, see copies_only).
    return torch.from_numpy(np.stack([np.asarray(band) for band in image.split()]))


# Pillow resampling filter ids (as stored in preprocessor_config.json's "resample") →
# torchvision interpolation names, with transformers' mapping (NEAREST → "nearest-exact").
_RESAMPLE_TO_TORCHVISION = {0: "NEAREST_EXACT", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC"}


def resize(pixels: torch.Tensor, height: int, width: int, resample: int) -> torch.Tensor:
    """Antialiased resize of ``[C, H, W]`` (uint8 in, uint8 out) to ``[C, height, width]``.

    ``resample`` is a Pillow filter id (3 = bicubic). Uses torchvision like HF's default
    processors; for uint8 bicubic it interpolates in float32, then rounds and clamps. A
    torchvision that has no tensor lanczos (before 0.28) resizes through Pillow's, as it does
    for PIL images.

    Raises:
        ValueError: a filter torchvision cannot apply to tensors (box, hamming).
    """
    from torchvision.transforms.v2 import functional as tvF

    name = _RESAMPLE_TO_TORCHVISION.get(int(resample))
    if name is None:
        supported = sorted(_RESAMPLE_TO_TORCHVISION)
        raise ValueError(f"Unsupported resample filter {resample}; supported: {supported}.")
    interpolation = tvF.InterpolationMode[name]
    try:
        return tvF.resize(pixels, [height, width], interpolation=interpolation, antialias=True)
    except NotImplementedError:
        if name != "LANCZOS":
            raise
    image = tvF.to_pil_image(pixels).resize((width, height), Image.Resampling.LANCZOS)
    return tvF.pil_to_tensor(image)


def split_tiles(pixels: torch.Tensor, tile_h: int, tile_w: int) -> torch.Tensor:
    """``[C, rows * tile_h, cols * tile_w]`` -> ``[rows * cols, C, tile_h, tile_w]``, the tiles
    in raster order (row by row)."""
    rows, cols = pixels.shape[1] // tile_h, pixels.shape[2] // tile_w
    grid = pixels.unfold(1, tile_h, tile_h).unfold(2, tile_w, tile_w)  # [C, rows, cols, th, tw]
    return grid.permute(1, 2, 0, 3, 4).reshape(rows * cols, -1, tile_h, tile_w)


def _floats(value: float | Sequence[float]) -> tuple[float, ...]:
    return (float(value),) if isinstance(value, (int, float)) else tuple(map(float, value))


@dataclass(frozen=True)
class Normalization:
    """Rescale (``x * rescale_factor``) then normalise (``(x - mean) / std``) per channel."""

    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Normalization:
        """From ``preprocessor_config.json`` keys; missing keys take the CLIP defaults."""
        return cls(
            do_rescale=bool(config.get("do_rescale", True)),
            rescale_factor=float(config.get("rescale_factor", 1 / 255)),
            do_normalize=bool(config.get("do_normalize", True)),
            image_mean=_floats(config.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=_floats(config.get("image_std", OPENAI_CLIP_STD)),
        )

    def folded(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """``(mean, std)`` such that ``(x - mean) / std`` in float32 is exactly ``self(x)``
        (the rescale folded in, as ``__call__`` does), or None when ``do_normalize`` is off."""
        if not self.do_normalize:
            return None
        mean, std = torch.tensor(self.image_mean), torch.tensor(self.image_std)
        if self.do_rescale:
            # HF folds the rescale into mean and std: (x - mean / r) / (std / r). The same
            # float32 operations in the same order give bit-identical pixels.
            mean = mean * (1.0 / self.rescale_factor)
            std = std * (1.0 / self.rescale_factor)
        return tuple(mean.tolist()), tuple(std.tolist())

    def tile_fields(self, tiles: torch.Tensor, defer: bool) -> dict[str, Any]:
        """``ProcessedImage``'s pixel fields for uint8 ``tiles`` ``[N, C, H, W]``: the float32
        normalised tiles, or with ``defer`` (and ``do_normalize``) the uint8 tiles with the
        folded mean and std, a quarter of the bytes to move (the model normalises them on
        the device)."""
        mean_std = self.folded() if defer else None
        if mean_std is None:
            return {"pixel_values": torch.stack([self(tile) for tile in tiles])}
        return {
            "pixel_values": tiles.contiguous(),
            "pixel_mean": mean_std[0],
            "pixel_std": mean_std[1],
        }

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[C, H, W]`` (any dtype) → ``[C, H, W]`` float32."""
        pixels = pixels.to(torch.float32)
        if self.do_normalize:
            mean, std = (torch.tensor(v).view(-1, 1, 1) for v in self.folded())
            return (pixels - mean) / std
        if self.do_rescale:
            return pixels * self.rescale_factor
        return pixels
