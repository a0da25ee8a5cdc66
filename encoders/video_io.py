"""Videos as processors read them: encoded files decoded with PyAV, or frames given as arrays.

A video reaches a video processor as a ``VideoSource``: the encoded file (bytes, or a path),
decoded with PyAV (FFmpeg) the way transformers' ``read_video_pyav`` decodes it (frames in
decoding order from the start, converted to ``rgb24``), or ``VideoFrames``, frames the caller
decoded already. ``open_video`` gives a ``VideoReader`` of either: its ``metadata`` (frame count,
frame rate, size) is known before any frame is decoded, so that a processor can pick its frames
and check its limits first, then ``frames(indices)`` decodes only up to the last frame it needs.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mm_serve.encoders.image_io import to_rgb


@dataclass(frozen=True)
class VideoMetadata:
    """What is known of a video before its frames are decoded.

    ``total_num_frames``: frames in the video; ``fps``: its frame rate in frames per second
    (None: unknown, as for frames given without one); ``height``, ``width``: in pixels.
    """

    total_num_frames: int
    fps: float | None
    height: int
    width: int


@dataclass(eq=False)
class VideoFrames:
    """Frames decoded already: uint8 ``[T, H, W, 3]`` RGB, and their rate (None: unknown)."""

    frames: np.ndarray
    fps: float | None = None

    def content_for_hash(self) -> tuple[tuple[Any, ...], memoryview]:
        """(metadata, pixel bytes) that identify these frames (``MultiModalHasher.hash_video``)."""
        fps = None if self.fps is None else repr(self.fps)  # the hash encodes no floats
        metadata = (str(self.frames.dtype), tuple(self.frames.shape), fps)
        return metadata, memoryview(np.ascontiguousarray(self.frames)).cast("B")


VideoSource = bytes | str | VideoFrames


def as_video_source(video: Any) -> VideoSource:
    """A video as a caller passes it → a ``VideoSource``.

    Accepts encoded bytes (``bytes``, ``bytearray``, ``memoryview``), a file path (``str`` or
    ``Path``), ``VideoFrames``, frames (a ``[T, H, W, C]`` array or tensor, or a list of PIL
    images or ``[H, W, C]`` arrays), or vLLM's ``(frames, metadata)`` pair whose metadata dict
    may give the frames' ``"fps"``. Frames are uint8 with 1 or 3 channels (grayscale repeated
    to RGB, as transformers does); PIL frames of another mode are converted with ``to_rgb``.

    Raises:
        ValueError: another type, frames of another dtype or channel count, frames of
            different sizes, or no frames.
    """
    if isinstance(video, (bytes, bytearray, memoryview)):
        return bytes(video)
    if isinstance(video, (str, Path)):
        return str(video)
    if isinstance(video, VideoFrames):
        return video
    fps = None
    if isinstance(video, tuple) and len(video) == 2 and isinstance(video[1], dict):
        video, metadata = video
        fps = metadata.get("fps")
        if fps is not None and (not isinstance(fps, (int, float)) or fps <= 0):
            raise ValueError(f"A video's metadata fps must be a positive number, not {fps!r}.")
    return VideoFrames(frames_array(video), None if fps is None else float(fps))


def frames_array(frames: Any) -> np.ndarray:
    """Frames → one uint8 ``[T, H, W, 3]`` array (see ``as_video_source``)."""
    if hasattr(frames, "detach"):  # a torch tensor
        frames = frames.detach().cpu().numpy()
    if isinstance(frames, np.ndarray):
        if frames.ndim != 4:
            raise ValueError(
                f"A video array must be [frames, height, width, channels], not {frames.shape}."
            )
        stacked = frames
    elif isinstance(frames, (list, tuple)) and frames:
        stacked = np.stack([_frame_array(frame) for frame in _same_size(frames)])
    else:
        raise ValueError(
            f"Cannot read a video from a {type(frames).__name__}; pass a file (bytes or a path), "
            "a [T, H, W, 3] uint8 array, or a list of frames (PIL images or [H, W, 3] arrays)."
        )
    if stacked.dtype != np.uint8:
        raise ValueError(f"Video frames must be uint8, not {stacked.dtype}.")
    if stacked.shape[0] == 0 or stacked.shape[1] == 0 or stacked.shape[2] == 0:
        raise ValueError(f"The video has no pixels: frames of shape {stacked.shape}.")
    if stacked.shape[-1] == 1:  # grayscale: repeated to RGB, as transformers' grayscale_to_rgb
        stacked = np.repeat(stacked, 3, axis=-1)
    if stacked.shape[-1] != 3:
        raise ValueError(
            f"Video frames must have 1 or 3 channels (last axis), not {stacked.shape}."
        )
    return np.ascontiguousarray(stacked)


def _same_size(frames: Sequence[Any]) -> Sequence[Any]:
    sizes = {_frame_size(frame) for frame in frames}
    if len(sizes) > 1:
        raise ValueError(f"A video's frames must all have one size, got {sorted(sizes)}.")
    return frames


def _frame_size(frame: Any) -> tuple[int, int]:
    if isinstance(frame, Image.Image):
        return frame.height, frame.width
    return tuple(np.shape(frame)[:2])


def _frame_array(frame: Any) -> np.ndarray:
    """One frame → ``[H, W, C]`` (PIL frames as RGB)."""
    if isinstance(frame, Image.Image):
        return np.asarray(frame if frame.mode == "RGB" else to_rgb(frame))
    array = np.asarray(frame)
    if array.ndim == 2:
        array = array[..., None]
    if array.ndim != 3:
        raise ValueError(f"A video frame must be [height, width, channels], not {array.shape}.")
    return array


class VideoReader:
    """One video's metadata and frames; close it (or use it as a context manager) when done."""

    metadata: VideoMetadata

    def frames(self, indices: Sequence[int]) -> Iterator[np.ndarray]:
        """The frames at ``indices`` (ascending), uint8 ``[H, W, 3]`` each, in order."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> VideoReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _ArrayReader(VideoReader):
    def __init__(self, video: VideoFrames) -> None:
        self.video = video
        count, height, width, _ = video.frames.shape
        self.metadata = VideoMetadata(count, video.fps, height, width)

    def frames(self, indices: Sequence[int]) -> Iterator[np.ndarray]:
        for index in indices:
            yield self.video.frames[index]


class _PyAVReader(VideoReader):
    """A container opened with PyAV; its first video stream is read."""

    def __init__(self, source: bytes | str, what: str) -> None:
        import av

        self.what = what
        try:
            self.container = av.open(io.BytesIO(source) if isinstance(source, bytes) else source)
        except (av.FFmpegError, OSError, ValueError) as e:
            raise ValueError(f"Cannot decode {what}: not a video in a known format ({e}).") from e
        try:
            if not self.container.streams.video:
                raise ValueError(f"Cannot decode {what}: it has no video stream.")
            self.stream = self.container.streams.video[0]
            rate = self.stream.average_rate
            fps = float(rate) if rate else None
            height, width = self.stream.height, self.stream.width
            self.metadata = VideoMetadata(self._count_frames(), fps, height, width)
        except BaseException:
            self.container.close()
            raise

    def _count_frames(self) -> int:
        """The stream's frame count from its header, else its packets counted (no decoding)."""
        if self.stream.frames > 0:
            return int(self.stream.frames)
        try:
            count = sum(1 for p in self.container.demux(self.stream) if p.size)
            self.container.seek(0)
        except Exception as e:  # PyAV raises FFmpeg errors of many kinds on corrupt data
            raise ValueError(f"Cannot decode {self.what}: {e}") from e
        return count

    def frames(self, indices: Sequence[int]) -> Iterator[np.ndarray]:
        wanted, last = set(indices), max(indices)
        try:
            self.container.seek(0)
            for i, frame in enumerate(self.container.decode(self.stream)):
                if i > last:
                    break
                if i in wanted:
                    yield frame.to_ndarray(format="rgb24")
        except Exception as e:  # PyAV raises FFmpeg errors of many kinds on corrupt data
            raise ValueError(f"Cannot decode {self.what}: {e}") from e

    def close(self) -> None:
        self.container.close()


def open_video(source: VideoSource, max_pixels: int | None = None) -> VideoReader:
    """A ``VideoReader`` of ``source``; only the header is read (PyAV) at this point.

    Raises:
        ValueError: empty or undecodable data, no video stream, a missing file, frames of
            zero size or above ``max_pixels`` (width x height, None: no limit), or no frames.
    """
    if isinstance(source, VideoFrames):
        reader: VideoReader = _ArrayReader(source)
    elif isinstance(source, bytes):
        if not source:
            raise ValueError("Cannot decode the video data: it is empty.")
        reader = _PyAVReader(source, "the video data")
    elif isinstance(source, str):
        if not Path(source).is_file():
            raise ValueError(f"Video file not found: {source!r}.")
        reader = _PyAVReader(source, f"the video file {source!r}")
    else:
        raise ValueError(f"Cannot read a video from a {type(source).__name__}.")
    meta = reader.metadata
    try:
        if meta.height <= 0 or meta.width <= 0:
            raise ValueError(f"The video is {meta.width}x{meta.height} pixels: nothing to process.")
        if max_pixels is not None and meta.width * meta.height > max_pixels:
            raise ValueError(
                f"The video is {meta.width}x{meta.height} = {meta.width * meta.height} pixels "
                f"a frame, above the limit of {max_pixels} (max_pixels)."
            )
        if meta.total_num_frames <= 0:
            raise ValueError("The video has no frames.")
    except ValueError:
        reader.close()
        raise
    return reader
