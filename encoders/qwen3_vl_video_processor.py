"""Qwen3-VL video processor: frames sampled (2 per second by default), resized within a pixel
budget for the whole clip, temporal patches of 2 frames, each patch's time written as text.

As transformers' ``Qwen3VLVideoProcessor`` and ``Qwen3VLProcessor`` (5.23):

- frames: ``num_frames``, or ``int(total / video_fps * fps)`` clamped to ``[min_frames,
  max_frames]`` and the video's length, at ``round(linspace(0, total - 1, n))`` (all with
  ``do_sample_frames`` off; no frame rate counts as 24 per second);
- size (``smart_resize``): sides rounded to multiples of ``patch * merge`` (scaled up first if
  below one) with the area of all ``T`` frames (whole temporal patches, the last padded with the
  last frame) within ``[min_pixels, max_pixels]``;
- prompt: per temporal patch ``i``, ``<{t_i:.1f} seconds>``, ``<|vision_start|>``,
  ``h * w / merge**2`` video tokens, ``<|vision_end|>``; ``t_i`` the mean time of the patch's
  first and last frame (``frame index / video fps``). These are the item's
  ``ProcessedImage.token_ids``; the model embeds the text among them as text."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mm_serve.encoders.base import ProcessedImage
from mm_serve.encoders.qwen2_vl_processor import MAX_ASPECT_RATIO
from mm_serve.encoders.qwen2_vl_video_processor import Qwen2VLVideoProcessor
from mm_serve.encoders.video_io import VideoMetadata, VideoSource, open_video
from mm_serve.encoders.video_processors import VideoLimits

# transformers' Qwen3VLVideoProcessor defaults: areas in pixels, frame counts, frames a second.
DEFAULT_MIN_PIXELS = 128 * 32 * 32
DEFAULT_MAX_PIXELS = 32 * 32 * 768
DEFAULT_MIN_FRAMES, DEFAULT_MAX_FRAMES = 4, 768
DEFAULT_SAMPLE_FPS = 2.0
DEFAULT_MAX_VIDEO_TOKENS = 768  # per frame, with cap_pixels_per_frame
# The frame rate of frames given without one (transformers' Qwen3VLProcessor).
DEFAULT_VIDEO_FPS = 24.0


def smart_resize(
    num_frames: int,
    height: int,
    width: int,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """Resized ``(height, width)`` of ``num_frames`` frames: multiples of ``factor`` whose area
    times the frames rounded to ``temporal_factor`` lies in ``[min_pixels, max_pixels]``
    (transformers' ``video_processing_qwen3_vl.smart_resize``, the Qwen2-VL paper's dynamic
    resolution extended over time). Sides below ``factor`` are first scaled up to it.

    Raises:
        ValueError: fewer frames than ``temporal_factor``, or an aspect ratio above 200.
    """
    if num_frames < temporal_factor:
        raise ValueError(
            f"The video has {num_frames} frame(s) after sampling; Qwen3-VL needs at least "
            f"{temporal_factor}."
        )
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"The video is {width}x{height} pixels: its aspect ratio must be at most "
            f"{MAX_ASPECT_RATIO}."
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patch_times(indices: list[int], video_fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal patch: the mean of its first and last frame's time, frames
    padded with the last one (transformers' ``Qwen3VLProcessor._calculate_timestamps``)."""
    padded = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch_size)
    times = [index / video_fps for index in padded]
    step = temporal_patch_size
    return [(times[i] + times[i + step - 1]) / 2 for i in range(0, len(times), step)]


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


@dataclass(frozen=True)
class VideoPromptTokens:
    """The token ids of a Qwen3-VL video's prompt, from the checkpoint's ``tokenizer.json``
    (``tokenizer_file``): ``<|vision_start|>``, ``<|vision_end|>``, ``<|video_pad|>``."""

    tokenizer_file: str
    vision_start: int
    vision_end: int
    video: int

    def timestamp(self, seconds: float) -> tuple[int, ...]:
        """``<{seconds:.1f} seconds>`` as the tokenizer splits it between two special tokens
        (where it stands in the prompt)."""
        ids = (
            _tokenizer(self.tokenizer_file)
            .encode(
                f"<|vision_start|><{seconds:.1f} seconds><|vision_start|>", add_special_tokens=False
            )
            .ids
        )
        return tuple(ids[1:-1])

    def expansion(self, times: list[float], tokens_per_patch: int) -> tuple[int, ...]:
        """The placeholder's tokens: per temporal patch its time, vision start, video tokens,
        vision end."""
        tokens: list[int] = []
        for seconds in times:
            tokens += self.timestamp(seconds)
            tokens += [self.vision_start, *[self.video] * tokens_per_patch, self.vision_end]
        return tuple(tokens)


@dataclass(kw_only=True, eq=False)
class Qwen3VLVideoProcessor(Qwen2VLVideoProcessor):
    """Sample → resize → (rescale, normalise, patchify) as Qwen2-VL's, with Qwen3-VL's frame
    sampling and clip-wide pixel budget (module doc). ``preprocess`` returns Qwen2-VL's pixels
    and grid (``Qwen2VLVideoProcessor``) with ``token_ids`` the placeholder's tokens (time
    texts among the video tokens) and ``num_tokens = len(token_ids)``. ``min_pixels`` and
    ``max_pixels`` (also as ``mm_processor_kwargs``) bound the area of all frames together,
    as HF's ``size``."""

    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    do_sample_frames: bool = True
    fps: float | None = DEFAULT_SAMPLE_FPS
    max_video_tokens: int = DEFAULT_MAX_VIDEO_TOKENS
    prompt_tokens: VideoPromptTokens

    @classmethod
    def from_qwen3_config(
        cls, config: Mapping[str, Any], prompt_tokens: VideoPromptTokens
    ) -> Qwen3VLVideoProcessor:
        """From transformers' ``Qwen3VLVideoProcessor`` settings (HF's defaults where missing;
        pixel bounds from ``size.shortest_edge``/``size.longest_edge``, areas)."""
        size = dict(config.get("size") or {})
        fps, num_frames = config.get("fps", DEFAULT_SAMPLE_FPS), config.get("num_frames")
        return cls(
            min_pixels=int(size.get("shortest_edge", DEFAULT_MIN_PIXELS)),
            max_pixels=int(size.get("longest_edge", DEFAULT_MAX_PIXELS)),
            **cls.patching_from_config(config),
            do_sample_frames=bool(config.get("do_sample_frames", True)),
            fps=None if fps is None or num_frames is not None else float(fps),
            num_frames=None if num_frames is None else int(num_frames),
            min_frames=int(config.get("min_frames", DEFAULT_MIN_FRAMES)),
            max_frames=int(config.get("max_frames", DEFAULT_MAX_FRAMES)),
            cap_pixels_per_frame=bool(config.get("cap_pixels_per_frame") or False),
            max_video_tokens=int(config.get("max_video_tokens", DEFAULT_MAX_VIDEO_TOKENS)),
            prompt_tokens=prompt_tokens,
        )

    def sample_indices(self, metadata: VideoMetadata) -> list[int]:
        """The frames to keep, as transformers' ``Qwen3VLVideoProcessor.sample_frames``
        (``num_frames`` above the video's length repeats frames, as HF).

        Raises:
            ValueError: ``fps`` and ``num_frames`` both set.
        """
        total = metadata.total_num_frames
        if not self.do_sample_frames:
            return list(range(total))
        if self.num_frames is not None and self.fps is not None:
            raise ValueError("Sample video frames by fps or by num_frames, not both.")
        num_frames = self.num_frames
        if num_frames is None and self.fps is not None:
            video_fps = metadata.fps or DEFAULT_VIDEO_FPS
            num_frames = int(total / video_fps * self.fps)
            num_frames = min(max(num_frames, self.min_frames), self.max_frames, total)
        if num_frames is None:
            num_frames = min(max(total, self.min_frames), self.max_frames)
        return np.linspace(0, total - 1, num_frames).round().astype(int).tolist()

    def target_size(self, height: int, width: int, num_frames: int) -> tuple[int, int]:
        """The resized ``(height, width)`` of ``num_frames`` frames (module doc); with
        ``cap_pixels_per_frame`` each frame gets at most ``max_video_tokens`` patches of
        ``patch * merge`` pixels, or its share of ``max_pixels``, as HF."""
        if not self.do_resize:
            return height, width
        factor, max_pixels = self.patch_size * self.merge_size, self.max_pixels
        if self.cap_pixels_per_frame:
            frame_cap = self.max_video_tokens * factor * factor
            per_frame = max(min(frame_cap, max_pixels // num_frames), int(self.min_pixels * 1.05))
            max_pixels = per_frame * num_frames
        return smart_resize(
            num_frames,
            height,
            width,
            self.temporal_patch_size,
            factor,
            self.min_pixels,
            max_pixels,
        )

    def prompt_token_ids(self, indices: list[int], meta: VideoMetadata) -> tuple[int, ...]:
        """The placeholder's tokens for the frames ``indices`` of a video of ``meta``."""
        height, width = self.target_size(meta.height, meta.width, len(indices))
        per_patch = (height // self.patch_size) * (width // self.patch_size) // self.merge_size**2
        times = patch_times(indices, meta.fps or DEFAULT_VIDEO_FPS, self.temporal_patch_size)
        return self.prompt_tokens.expansion(times, per_patch)

    def preprocess(
        self, video: VideoSource, limits: VideoLimits, defer_normalization: bool = False
    ) -> ProcessedImage:
        """Decode the sampled frames, check ``limits`` on the whole placeholder (before
        decoding), resize; see the class docstring.

        Raises:
            ValueError: as ``Qwen2VLVideoProcessor.preprocess``, or fewer than
                ``temporal_patch_size`` frames after sampling.
        """
        with open_video(video, limits.max_pixels) as reader:
            meta = reader.metadata
            indices = self.sample_indices(meta)
            token_ids = self.prompt_token_ids(indices, meta)
            limits.check(len(indices), len(token_ids))
            height, width = self.target_size(meta.height, meta.width, len(indices))
            distinct = sorted(set(indices))
            decoded = [self._resized(f, meta, height, width) for f in reader.frames(distinct)]
        if len(decoded) != len(distinct):
            raise ValueError(
                f"The video ended after {len(decoded)} of the frames its header announced."
            )
        by_index = dict(zip(distinct, decoded, strict=True))
        frames = torch.stack([by_index[i] for i in indices])
        item = self._finish(frames, meta, len(indices), defer_normalization)
        return dataclasses.replace(
            item, num_tokens=len(token_ids), token_ids=token_ids, second_per_grid_t=None
        )


def qwen3_vl_video_processor(
    config: dict[str, Any], hf_config: Any, model_path: str | Path
) -> Qwen3VLVideoProcessor:
    """Qwen3-VL (the family registry's factory): transformers' ``Qwen3VLVideoProcessor``
    settings and the prompt's token ids from the checkpoint's ``tokenizer.json``.

    Raises:
        FileNotFoundError: the checkpoint has no ``tokenizer.json``.
        ValueError: the tokenizer lacks ``<|vision_start|>`` or ``<|vision_end|>``.
    """
    from mm_serve.checkpoint.families import config_get

    tokenizer_file = Path(model_path) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"Qwen3-VL videos need the checkpoint's {tokenizer_file}.")
    tokenizer = _tokenizer(str(tokenizer_file))
    start, end = (tokenizer.token_to_id(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    if start is None or end is None:
        raise ValueError(f"The tokenizer {tokenizer_file} lacks <|vision_start|>/<|vision_end|>.")
    video = config_get(hf_config, "video_token_id")
    tokens = VideoPromptTokens(str(tokenizer_file), start, end, int(video))
    return Qwen3VLVideoProcessor.from_qwen3_config(config, tokens)
