"""Qwen2-VL / Qwen2.5-VL video processor: frame sampling, per-frame dynamic resolution and
temporal patches of 2 frames.

Frames are picked as transformers' ``Qwen2VLVideoProcessor.sample_frames`` picks them (all of
them unless ``do_sample_frames``; then ``num_frames`` evenly spaced, or ``fps`` frames per
second of the video clamped to ``[min_frames, max_frames]``, rounded to whole temporal
patches), each frame is resized as an image is (``smart_resize`` within the video's own pixel
bounds, bicubic), and the frames are padded to a multiple of ``temporal_patch_size`` by
repeating the last one. A video of ``T`` frames resized to ``H x W`` gives
``ceil(T / temporal_patch_size) * (H / 28) * (W / 28)`` placeholder tokens. Pixels equal those
of transformers' ``Qwen2VLVideoProcessor`` given the same frames.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mm_serve.encoders.base import ProcessedImage
from mm_serve.encoders.image_io import resize
from mm_serve.encoders.qwen2_vl_processor import Qwen2VLPatching, patchify, smart_resize
from mm_serve.encoders.video_io import VideoMetadata, VideoSource, open_video
from mm_serve.encoders.video_processors import VIDEO_SAMPLING_KWARGS, VideoLimits, VideoProcessor

# transformers' Qwen2VLVideoProcessor defaults: resized frame areas in pixels, frame counts.
DEFAULT_MIN_PIXELS = 128 * 28 * 28
DEFAULT_MAX_PIXELS = 28 * 28 * 768
DEFAULT_MIN_FRAMES, DEFAULT_MAX_FRAMES = 4, 768
DEFAULT_MAX_VIDEO_TOKENS = 128000
# The frame rate of frames given without one (transformers' ``VideoMetadata.sampled_fps``).
DEFAULT_FPS = 24


@dataclass(kw_only=True, eq=False)
class Qwen2VLVideoProcessor(Qwen2VLPatching, VideoProcessor):
    """Sample → resize → (rescale, normalise, patchify); one video at a time.

    ``preprocess`` returns ``pixel_values`` ``[grid_t * grid_h * grid_w, 3 * temporal_patch_size
    * patch_size**2]`` float32 (or, deferred, the resized frames uint8 ``[T, 3, H, W]``),
    ``image_grid_thw = (grid_t, grid_h, grid_w)``, ``num_tokens = grid_t * grid_h * grid_w //
    merge_size**2`` and ``second_per_grid_t = temporal_patch_size / sampled fps`` (seconds).
    """

    KWARGS = ("min_pixels", "max_pixels", *VIDEO_SAMPLING_KWARGS)

    min_pixels: int = DEFAULT_MIN_PIXELS  # the video processor's defaults, not the image one's
    max_pixels: int = DEFAULT_MAX_PIXELS
    do_sample_frames: bool = False
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int = DEFAULT_MIN_FRAMES
    max_frames: int = DEFAULT_MAX_FRAMES
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = DEFAULT_MAX_VIDEO_TOKENS

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Qwen2VLVideoProcessor:
        """From video processor settings (``video_processors.read_video_processor_config``);
        pixel bounds as HF reads them: top-level ``min_pixels``/``max_pixels``, else
        ``size.shortest_edge``/``size.longest_edge`` (areas, despite the names)."""
        size = dict(config.get("size") or {})
        low, high = config.get("min_pixels"), config.get("max_pixels")
        low = size.get("shortest_edge", DEFAULT_MIN_PIXELS) if low is None else low
        high = size.get("longest_edge", DEFAULT_MAX_PIXELS) if high is None else high
        fps, num_frames = config.get("fps"), config.get("num_frames")
        return cls(
            min_pixels=int(low),
            max_pixels=int(high),
            **cls.patching_from_config(config),
            do_sample_frames=bool(config.get("do_sample_frames", False)),
            fps=None if fps is None else float(fps),
            num_frames=None if num_frames is None else int(num_frames),
            min_frames=int(config.get("min_frames", DEFAULT_MIN_FRAMES)),
            max_frames=int(config.get("max_frames", DEFAULT_MAX_FRAMES)),
            cap_pixels_per_frame=bool(config.get("cap_pixels_per_frame") or False),
            max_video_tokens=int(config.get("max_video_tokens", DEFAULT_MAX_VIDEO_TOKENS)),
        )

    def with_kwargs(self, kwargs: Mapping[str, Any]) -> Qwen2VLVideoProcessor:
        """This processor with ``KWARGS`` replaced (vLLM's ``mm_processor_kwargs``).

        ``fps`` or ``num_frames`` turns frame sampling on (unless ``do_sample_frames`` is
        given false) and replaces the other, which transformers would refuse alongside it;
        ``max_pixels`` alone lowers ``min_pixels`` to it where it was above.

        Raises:
            ValueError: another key, a value of the wrong type or not positive, or
                ``min_pixels`` above ``max_pixels``.
        """
        if not kwargs:
            return self
        unknown = sorted(set(kwargs) - set(self.KWARGS))
        if unknown:
            raise ValueError(
                f"Unknown mm_processor_kwargs {unknown}: videos take {list(self.KWARGS)}."
            )
        for name, value in kwargs.items():
            kind = bool if name == "do_sample_frames" else (int, float) if name == "fps" else int
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise ValueError(f"mm_processor_kwargs.{name} must be a {kind}, got {value!r}.")
            if kind is not bool and value <= 0:
                raise ValueError(f"mm_processor_kwargs.{name} must be positive, got {value!r}.")
        changes = dict(kwargs)
        if "fps" in kwargs or "num_frames" in kwargs:
            changes.setdefault("do_sample_frames", True)
            other = "num_frames" if "fps" in kwargs else "fps"
            changes.setdefault(other, None)
        if "fps" in changes and changes["fps"] is not None:
            changes["fps"] = float(changes["fps"])
        high = changes.get("max_pixels", self.max_pixels)
        changes.setdefault("min_pixels", min(self.min_pixels, high))
        if changes["min_pixels"] > high:
            raise ValueError(
                f"mm_processor_kwargs: min_pixels ({changes['min_pixels']}) must not exceed "
                f"max_pixels ({high})."
            )
        return dataclasses.replace(self, **changes)

    def sample_indices(self, metadata: VideoMetadata) -> list[int]:
        """The frames to keep, as transformers' ``Qwen2VLVideoProcessor.sample_frames``.

        Raises:
            ValueError: sampling by ``fps`` frames without a frame rate, sampling asked without
                ``fps`` or ``num_frames``, or a video too short for whole temporal patches.
        """
        total = metadata.total_num_frames
        if not self.do_sample_frames:
            return list(range(total))
        tps, num_frames = self.temporal_patch_size, self.num_frames
        if num_frames is not None and self.fps is not None:
            raise ValueError("Sample video frames by fps or by num_frames, not both.")
        if num_frames is not None:
            num_frames = round(num_frames / tps) * tps
        elif self.fps is not None:
            if metadata.fps is None:
                raise ValueError(
                    "The video's frames came without their frame rate: sampling by fps needs it "
                    '(pass (frames, {"fps": ...}), or sample by num_frames).'
                )
            max_frames = math.floor(min(self.max_frames, total) / tps) * tps
            wanted = total / metadata.fps * self.fps
            wanted = min(max(wanted, self.min_frames), max_frames, total)
            num_frames = math.floor(wanted / tps) * tps
        else:
            raise ValueError("Sampling video frames needs fps or num_frames.")
        if num_frames > total:
            raise ValueError(f"Cannot sample {num_frames} frames of a video of {total}.")
        if num_frames <= 0:
            raise ValueError(f"The video's {total} frames give no whole temporal patch of {tps}.")
        return torch.arange(0, total, total / num_frames).int().tolist()

    def target_size(self, height: int, width: int, num_frames: int) -> tuple[int, int]:
        """The resized ``(height, width)`` of the frames of a video of ``num_frames`` frames
        (with ``cap_pixels_per_frame``, each frame's share of ``max_video_tokens``, as HF)."""
        if not self.do_resize:
            return height, width
        factor, max_pixels = self.patch_size * self.merge_size, self.max_pixels
        if self.cap_pixels_per_frame:
            total_pixels = int(self.max_video_tokens * factor * factor * 0.9)
            share = total_pixels * self.temporal_patch_size // num_frames
            max_pixels = max(min(max_pixels, share), int(self.min_pixels * 1.05))
        return smart_resize(height, width, factor, self.min_pixels, max_pixels)

    def num_tokens(self, num_frames: int, height: int, width: int) -> int:
        """Placeholder tokens of ``num_frames`` frames of ``height x width`` input pixels."""
        resized_height, resized_width = self.target_size(height, width, num_frames)
        factor = self.patch_size * self.merge_size
        grid_t = -(-num_frames // self.temporal_patch_size)
        return grid_t * (resized_height // factor) * (resized_width // factor)

    def preprocess(
        self, video: VideoSource, limits: VideoLimits, defer_normalization: bool = False
    ) -> ProcessedImage:
        """Decode the sampled frames, check ``limits`` (before decoding), resize; see the
        class docstring for shapes.

        Raises:
            ValueError: an undecodable video, one over ``limits``, frames of changing size,
                fewer frames than its header announced, or (``do_resize`` off) sides that are
                not multiples of ``patch_size * merge_size``.
        """
        with open_video(video, limits.max_pixels) as reader:
            meta = reader.metadata
            indices = self.sample_indices(meta)
            limits.check(len(indices), self.num_tokens(len(indices), meta.height, meta.width))
            height, width = self.target_size(meta.height, meta.width, len(indices))
            frames = [self._resized(frame, meta, height, width) for frame in reader.frames(indices)]
        if len(frames) != len(indices):
            raise ValueError(
                f"The video ended after {len(frames)} of the frames its header announced."
            )
        return self._finish(torch.stack(frames), meta, len(indices), defer_normalization)

    def _resized(
        self, frame: np.ndarray, meta: VideoMetadata, height: int, width: int
    ) -> torch.Tensor:
        """One decoded ``[H, W, 3]`` frame → resized ``[3, height, width]`` uint8."""
        if frame.shape[:2] != (meta.height, meta.width):
            raise ValueError(
                f"The video's frames change size ({meta.width}x{meta.height}, then "
                f"{frame.shape[1]}x{frame.shape[0]})."
            )
        factor = self.patch_size * self.merge_size
        if height % factor or width % factor:
            raise ValueError(
                f"The video is {width}x{height} pixels; with do_resize off both sides must be "
                f"multiples of {factor}."
            )
        pixels = torch.from_numpy(np.ascontiguousarray(frame)).permute(2, 0, 1)
        return resize(pixels, height, width, self.resample) if self.do_resize else pixels

    def _finish(
        self, frames: torch.Tensor, meta: VideoMetadata, num_sampled: int, defer: bool
    ) -> ProcessedImage:
        """Resized frames ``[T, 3, H, W]`` uint8 → the processed video."""
        num_frames, _, height, width = frames.shape
        mean_std = self.normalization.folded() if defer else None
        pixels = frames.contiguous()
        if mean_std is None:
            pixels = self.normalization(pixels)
            pixels = patchify(pixels, self.patch_size, self.temporal_patch_size, self.merge_size)
        grid_t = -(-num_frames // self.temporal_patch_size)
        grid_h, grid_w = height // self.patch_size, width // self.patch_size
        # transformers' VideoMetadata.sampled_fps, then Qwen2_5_VLProcessor's second_per_grid_ts.
        fps = meta.fps
        sampled_fps = num_sampled / meta.total_num_frames * fps if fps else DEFAULT_FPS
        return ProcessedImage(
            pixel_values=pixels,
            num_tokens=grid_t * grid_h * grid_w // self.merge_size**2,
            image_grid_thw=(grid_t, grid_h, grid_w),
            pixel_mean=mean_std[0] if mean_std else (),
            pixel_std=mean_std[1] if mean_std else (),
            modality="video",
            second_per_grid_t=self.temporal_patch_size / sampled_fps,
        )


def qwen2_vl_video_processor(
    config: dict[str, Any], hf_config: Any, model_path: str | Path
) -> Qwen2VLVideoProcessor:
    """Qwen2-VL and Qwen2.5-VL (the family registry's factory): transformers'
    ``Qwen2VLVideoProcessor`` settings, as ``from_config``."""
    return Qwen2VLVideoProcessor.from_config(config)
