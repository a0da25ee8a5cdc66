"""Video processors: the interface a family's video processor implements, the limits every
video is checked against, and the factory that builds a checkpoint's from its settings.

A video goes through the same two steps as an image (``encoders/base.py``): the family's
``VideoProcessor.preprocess`` (in the preprocessing pool: decode, pick frames, resize) makes a
``ProcessedImage`` with ``modality == "video"``, and the model's ``embed_images`` embeds it
next to the images of the same step. A family that takes videos names its factory in
``mm_serve.checkpoint.families`` (``video_processor``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mm_serve.checkpoint.families import find_family, resolve
from mm_serve.encoders.base import ProcessedImage
from mm_serve.encoders.processors import (
    PREPROCESSOR_CONFIG,
    PROCESSOR_CONFIG,
    VIDEO_SAMPLING_KWARGS,
    _read_json_object,
)
from mm_serve.encoders.video_io import VideoSource

__all__ = ["VIDEO_SAMPLING_KWARGS", "VideoLimits", "VideoProcessor", "get_video_processor"]

VIDEO_PREPROCESSOR_CONFIG = "video_preprocessor_config.json"
DEFAULT_MAX_VIDEO_FRAMES = 128


@dataclass(frozen=True)
class VideoLimits:
    """What the server takes of one video, checked before its frames are decoded.

    ``max_frames``: frames after sampling (before the temporal padding); ``max_tokens``:
    placeholder tokens (0: no limit); ``max_pixels``: width x height of an input frame (None:
    no limit).
    """

    max_frames: int = DEFAULT_MAX_VIDEO_FRAMES
    max_tokens: int = 0
    max_pixels: int | None = None

    def check(self, num_frames: int, num_tokens: int) -> None:
        """Raises ValueError for a video of more frames or tokens than the limits."""
        if num_frames > self.max_frames:
            raise ValueError(
                f"The video has {num_frames} frames after sampling, above this server's limit "
                f"of {self.max_frames} (--max-video-frames); sample fewer, e.g. with "
                'mm_processor_kwargs {"fps": 1} or {"num_frames": 16}.'
            )
        if self.max_tokens and num_tokens > self.max_tokens:
            raise ValueError(
                f"The video expands to {num_tokens} tokens, more than the {self.max_tokens} this "
                "server takes per video; sample fewer frames (mm_processor_kwargs fps or "
                "num_frames) or lower max_pixels."
            )


class VideoProcessor:
    """Base of each family's video processor, built from the checkpoint's video processor
    settings (``read_video_processor_config``). ``KWARGS``: the ``mm_processor_kwargs`` keys
    it takes."""

    KWARGS: tuple[str, ...] = ()

    def preprocess(
        self, video: VideoSource, limits: VideoLimits, defer_normalization: bool = False
    ) -> ProcessedImage:
        """Decode, sample and resize ``video`` into one ``ProcessedImage`` (``modality`` video).

        Raises:
            ValueError: an undecodable or empty video, or one over ``limits``.
        """
        raise NotImplementedError

    def with_kwargs(self, kwargs: Mapping[str, Any]) -> VideoProcessor:
        """This processor with ``mm_processor_kwargs`` applied; ``self`` for an empty mapping.

        Raises:
            ValueError: a key not in ``KWARGS``, or an invalid value.
        """
        if kwargs:
            raise ValueError(f"Unknown mm_processor_kwargs {sorted(kwargs)} for videos.")
        return self

    def hash_kwargs(self) -> dict[str, str]:
        """Every setting that changes ``preprocess``'s result, for the video content hash."""
        return {name: repr(value) for name, value in sorted(vars(self).items())}


def video_kwargs(kwargs: Mapping[str, Any] | None, processor: VideoProcessor) -> dict[str, Any]:
    """The part of ``mm_processor_kwargs`` that ``processor`` takes."""
    return {k: v for k, v in (kwargs or {}).items() if k in processor.KWARGS}


def read_video_processor_config(model_path: str | Path) -> dict[str, Any]:
    """The video processor settings of a checkpoint folder, in transformers' order
    (``VideoProcessorMixin.get_video_processor_dict``): the ``"video_processor"`` object nested
    in ``processor_config.json``, else ``video_preprocessor_config.json``, else the image
    processor's ``preprocessor_config.json`` (the hub's Qwen2-VL checkpoints have only that).

    Raises:
        FileNotFoundError: none of them.
        ValueError: a file is not a JSON object, or the nested settings are not an object.
    """
    folder = Path(model_path)
    nested = (_read_json_object(folder / PROCESSOR_CONFIG) or {}).get("video_processor")
    if nested is not None:
        if not isinstance(nested, dict):
            raise ValueError(f"{folder / PROCESSOR_CONFIG}: 'video_processor' must be an object.")
        return nested
    for name in (VIDEO_PREPROCESSOR_CONFIG, PREPROCESSOR_CONFIG):
        config = _read_json_object(folder / name)
        if config is not None:
            return config
    raise FileNotFoundError(f"No video processor settings in {folder}.")


def get_video_processor(
    model_path: str | Path, hf_config: Any, mm_processor_kwargs: Mapping[str, Any] | None = None
) -> VideoProcessor | None:
    """The video processor of the checkpoint at ``model_path`` as its family builds it, with
    the keys of ``mm_processor_kwargs`` it takes applied; None for a family without videos.

    Raises:
        FileNotFoundError, ValueError: see ``read_video_processor_config``; bad settings.
    """
    family = find_family(hf_config)
    if family is None or family.video_processor is None:
        return None
    config = read_video_processor_config(model_path)
    processor = resolve(family.video_processor)(config, hf_config, model_path)
    return processor.with_kwargs(video_kwargs(mm_processor_kwargs, processor))
