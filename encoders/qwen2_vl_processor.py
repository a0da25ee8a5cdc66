"""Qwen2-VL / Qwen2.5-VL image processor: dynamic resolution, 14x14 patches, 2x2 merge.

An image keeps (about) its aspect ratio and is resized so that each side is a multiple of
``patch_size * merge_size`` (28) and its area lies in ``[min_pixels, max_pixels]``; the vision
tower then sees ``grid_h x grid_w`` patches and the LLM ``grid_h * grid_w / merge_size**2``
image tokens. Pixels equal those of transformers' default ``Qwen2VLImageProcessor``
(torchvision backend), which both Qwen2-VL and Qwen2.5-VL checkpoints load.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from mm_serve.encoders.base import ImageProcessor, ProcessedImage
from mm_serve.encoders.image_io import Normalization, pil_to_tensor, resize
from mm_serve.utils.transfer import host_to_device

DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
MAX_ASPECT_RATIO = 200
# The resized area of an image_url part with detail "low": at most 448 x 448 pixels, that is
# 256 image tokens (one per 28 x 28 pixels), about a fifth of the default budget's 1280.
LOW_DETAIL_MAX_PIXELS = 448 * 448
# vLLM's mm_processor_kwargs for Qwen2-VL and Qwen2.5-VL images: bounds on the resized area.
MM_PROCESSOR_KWARGS = ("min_pixels", "max_pixels")


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> tuple[int, int]:
    """Target ``(height, width)`` in pixels: multiples of ``factor``, area in range, aspect kept.

    From the Qwen2-VL paper's "Naive Dynamic Resolution" (Wang et al. 2024, arXiv:2409.12191),
    as implemented by the Qwen team in HF transformers
    (``models/qwen2_vl/image_processing_qwen2_vl.py``): round each side to the nearest multiple
    of ``factor`` (Python's ``round``: halves go to even); if the area then exceeds
    ``max_pixels``, scale both sides down by ``sqrt(area / max_pixels)`` and floor to
    multiples; if it is below ``min_pixels``, scale up and ceil. Never below ``factor``.

    Raises:
        ValueError: a side is not positive, or the aspect ratio exceeds 200 (as HF).
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"The image is {width}x{height} pixels: it has no pixels to process.")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"The image is {width}x{height} pixels: its aspect ratio must be at most "
            f"{MAX_ASPECT_RATIO}, got {max(height, width) / min(height, width):.1f}."
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patchify(
    pixels: torch.Tensor, patch_size: int, temporal_patch_size: int, merge_size: int
) -> torch.Tensor:
    """``[C, H, W]`` (an image) or ``[T, C, H, W]`` (video frames) →
    ``[grid_t * grid_h * grid_w, C * temporal_patch_size * patch_size**2]``.

    Row order groups each ``merge_size x merge_size`` block of neighbouring patches together
    (the vision tower's patch merger relies on it), temporal patch by temporal patch; each row
    is ``(C, t, py, px)`` flattened. A still image is one frame repeated
    ``temporal_patch_size`` times (``grid_t = 1``); video frames are padded to a multiple of
    ``temporal_patch_size`` by repeating the last one, as HF's ``Qwen2VLVideoProcessor``.
    """
    tp, p, m = temporal_patch_size, patch_size, merge_size
    if pixels.dim() == 3:
        frames = pixels.unsqueeze(0).expand(tp, -1, -1, -1)
    else:
        pad = -pixels.shape[0] % tp
        frames = torch.cat([pixels, pixels[-1:].expand(pad, -1, -1, -1)]) if pad else pixels
    num_frames, channels, height, width = frames.shape
    grid_t, grid_h, grid_w = num_frames // tp, height // p, width // p
    blocks = frames.reshape(grid_t, tp, channels, grid_h // m, m, p, grid_w // m, m, p)
    blocks = blocks.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [gt, gh/m, gw/m, m, m, C, tp, p, p]
    return blocks.reshape(grid_t * grid_h * grid_w, channels * tp * p * p)


def normalize_patches(
    patches: torch.Tensor, pixel_mean: Sequence[float], pixel_std: Sequence[float]
) -> torch.Tensor:
    """uint8 patches ``[N, C * K]`` (channel-major rows, as ``patchify`` makes) → float32
    ``(x - mean[c]) / std[c]``, on ``patches``' device, bit-identical to normalising the image
    first (the same float32 operations; patchify only moves pixels)."""
    channels = len(pixel_mean)
    x = patches.view(patches.shape[0], channels, -1).to(torch.float32)
    mean = host_to_device(torch.tensor(pixel_mean, dtype=torch.float32), x.device)
    std = host_to_device(torch.tensor(pixel_std, dtype=torch.float32), x.device)
    return ((x - mean.view(1, -1, 1)) / std.view(1, -1, 1)).view(patches.shape)


@dataclass(kw_only=True, eq=False)
class Qwen2VLPatching:
    """The settings Qwen2-VL's image and video processors share: the resized area within
    ``[min_pixels, max_pixels]`` (``smart_resize``, PIL filter ``resample``, bicubic), patches
    of ``patch_size`` pixels and ``temporal_patch_size`` frames, ``merge_size**2`` patches per
    token, and the normalisation.

    Raises (at construction):
        ValueError: ``min_pixels`` above ``max_pixels``.
    """

    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    normalization: Normalization = field(default_factory=Normalization)
    do_resize: bool = True
    resample: int = 3

    def __post_init__(self) -> None:
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"min_pixels ({self.min_pixels}) must not exceed max_pixels ({self.max_pixels})."
            )

    @staticmethod
    def patching_from_config(config: Mapping[str, Any]) -> dict[str, Any]:
        """These settings but the pixel bounds, from processor settings (HF's defaults for
        those missing)."""
        return dict(
            patch_size=int(config.get("patch_size", 14)),
            temporal_patch_size=int(config.get("temporal_patch_size", 2)),
            merge_size=int(config.get("merge_size", 2)),
            normalization=Normalization.from_config(config),
            do_resize=bool(config.get("do_resize", True)),
            resample=int(config.get("resample", 3)),
        )


@dataclass(kw_only=True, eq=False)
class Qwen2VLImageProcessor(Qwen2VLPatching, ImageProcessor):
    """Resize (smart_resize, bicubic) → rescale → normalise → patchify; one image at a time.

    Build it with ``from_config(image_processor_settings)``. ``preprocess`` returns
    ``pixel_values`` ``[grid_h * grid_w, 3 * temporal_patch_size * patch_size**2]`` float32,
    ``image_grid_thw = (1, grid_h, grid_w)`` and ``num_tokens = grid_h * grid_w //
    merge_size**2``.
    """

    do_convert_rgb: bool = True

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], max_pixels: int | None = None
    ) -> Qwen2VLImageProcessor:
        """From image processor settings (``processors.read_image_processor_config``).

        Pixel bounds come, as in HF, from top-level ``min_pixels``/``max_pixels`` when present,
        else from ``size.shortest_edge``/``size.longest_edge`` (despite the names: areas in
        pixels). ``max_pixels`` overrides the config's bound; ``min_pixels`` is then clamped
        not to exceed it.
        """
        size = dict(config.get("size") or {})
        low = config.get("min_pixels")
        low = low if low is not None else size.get("shortest_edge", size.get("min_pixels"))
        high = config.get("max_pixels")
        high = high if high is not None else size.get("longest_edge", size.get("max_pixels"))
        low = DEFAULT_MIN_PIXELS if low is None else int(low)
        high = DEFAULT_MAX_PIXELS if high is None else int(high)
        if max_pixels is not None:
            high = int(max_pixels)
            low = min(low, high)
        return cls(
            min_pixels=low,
            max_pixels=high,
            **cls.patching_from_config(config),
            do_convert_rgb=bool(config.get("do_convert_rgb", True)),
        )

    def with_kwargs(self, kwargs: Mapping[str, Any]) -> Qwen2VLImageProcessor:
        """This processor with ``min_pixels`` and/or ``max_pixels`` (positive ints) replaced,
        as vLLM's ``mm_processor_kwargs``; ``max_pixels`` alone also lowers ``min_pixels`` to
        it where it was above (as ``from_config``'s override does).

        Raises:
            ValueError: another key, a value that is not a positive int, or ``min_pixels``
                above ``max_pixels``.
        """
        if not kwargs:
            return self
        unknown = sorted(set(kwargs) - set(MM_PROCESSOR_KWARGS))
        if unknown:
            raise ValueError(
                f"Unknown mm_processor_kwargs {unknown}: this model takes "
                f"{list(MM_PROCESSOR_KWARGS)}."
            )
        for name, value in kwargs.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"mm_processor_kwargs.{name} must be a positive int, got {value!r}."
                )
        high = kwargs.get("max_pixels", self.max_pixels)
        low = kwargs.get("min_pixels", min(self.min_pixels, high))
        if low > high:
            raise ValueError(
                f"mm_processor_kwargs: min_pixels ({low}) must not exceed max_pixels ({high})."
            )
        return dataclasses.replace(self, min_pixels=low, max_pixels=high)

    def low_detail(self) -> Qwen2VLImageProcessor:
        """At most ``LOW_DETAIL_MAX_PIXELS`` (448 x 448) resized pixels: 256 image tokens."""
        high = min(self.max_pixels, LOW_DETAIL_MAX_PIXELS)
        return dataclasses.replace(self, min_pixels=min(self.min_pixels, high), max_pixels=high)

    @property
    def factor(self) -> int:
        """Side lengths are multiples of this many pixels (one merged token's width)."""
        return self.patch_size * self.merge_size

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """The resized ``(height, width)`` of a ``height x width`` input image."""
        if not self.do_resize:
            return height, width
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def copies_only(self, image: Image.Image) -> bool:
        """An RGB image already at its target size, normalised later on the device."""
        if image.mode != "RGB" or self.normalization.folded() is None:
            return False
        try:
            return self.target_size(image.height, image.width) == (image.height, image.width)
        except ValueError:  # no size it takes: the pool reports it, as for any image
            return False

    def num_tokens(self, height: int, width: int) -> int:
        """Image tokens for an input of this size, computed without touching pixels."""
        resized_height, resized_width = self.target_size(height, width)
        return (resized_height // self.factor) * (resized_width // self.factor)

    @property
    def max_num_tokens(self) -> int:
        """An upper bound on ``num_tokens`` over every image ``smart_resize`` accepts.

        Three cases of ``smart_resize`` (``f = patch_size * merge_size``, aspect ratio at most
        200): the area stays at most ``max_pixels``; or a side is clamped to ``f`` and the other
        is at most ``sqrt(200 * max_pixels)``; or the area is rounded up from ``min_pixels``,
        adding at most ``f`` to each side, whose sum is at most ``sqrt(min_pixels) * 15.2``.
        """
        f = self.patch_size * self.merge_size
        root_min = math.isqrt(self.min_pixels) + 1
        return max(
            self.max_pixels // f**2,
            math.isqrt(MAX_ASPECT_RATIO * self.max_pixels) // f + 1,
            (self.min_pixels + 16 * f * root_min + f * f) // f**2,
        )

    def preprocess(self, image: Image.Image, defer_normalization: bool = False) -> ProcessedImage:
        """PIL image (any mode) → patches; see the class docstring for shapes.

        With ``defer_normalization`` (and a normalising config) the result is the resized
        image itself, uint8 ``[C, H, W]`` (half the bytes of its patches, whose two temporal
        frames repeat it), carrying the folded mean and std: ``patchify`` then
        ``normalize_patches`` finish it on the device.

        Raises:
            ValueError: zero-sized image, aspect ratio above 200, or (with ``do_resize`` off)
                sides that are not multiples of ``patch_size * merge_size``.
        """
        pixels = pil_to_tensor(image, self.do_convert_rgb)  # [3, H, W] uint8
        height, width = self.target_size(*pixels.shape[-2:])
        if height % self.factor or width % self.factor:
            raise ValueError(
                f"The image is {width}x{height} pixels; with do_resize off both sides must be "
                f"multiples of {self.factor}."
            )
        if self.do_resize:
            pixels = resize(pixels, height, width, self.resample)
        mean_std = self.normalization.folded() if defer_normalization else None
        if mean_std is None:
            pixels = self.normalization(pixels)
            pixels = patchify(pixels, self.patch_size, self.temporal_patch_size, self.merge_size)
        grid_h, grid_w = height // self.patch_size, width // self.patch_size
        return ProcessedImage(
            pixel_values=pixels,
            num_tokens=grid_h * grid_w // self.merge_size**2,
            image_grid_thw=(1, grid_h, grid_w),
            pixel_mean=mean_std[0] if mean_std else (),
            pixel_std=mean_std[1] if mean_std else (),
        )
