"""Short generated video clips for tests: moving shapes, encoded with PyAV; and a file as HF
decodes it."""

from __future__ import annotations

import io
import os

import numpy as np


def moving_shapes(num_frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """``[num_frames, height, width, 3]`` uint8: a colour gradient with a rectangle moving
    right and a disc moving down, over light noise (so no two frames are alike)."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    base = np.stack([xs * 255 // max(width - 1, 1), ys * 255 // max(height - 1, 1)], -1)
    base = np.concatenate([base, np.full((height, width, 1), 96)], -1).astype(np.int32)
    frames = []
    for t in range(num_frames):
        frame = base + rng.integers(-12, 13, base.shape)
        x0 = (t * width) // (2 * num_frames)
        frame[height // 4 : height // 2, x0 : x0 + width // 4] = (230, 40, 40)
        cy, cx, r = (t * height) // num_frames, 2 * width // 3, max(2, min(height, width) // 6)
        frame[(ys - cy) ** 2 + (xs - cx) ** 2 <= r * r] = (30, 200, 60)
        frames.append(np.clip(frame, 0, 255).astype(np.uint8))
    return np.stack(frames)


def encode_clip(
    frames: np.ndarray, fps: int = 8, container: str = "mov", codec: str = "png"
) -> bytes:
    """``frames`` (``[T, H, W, 3]`` uint8 RGB) as a video file of ``fps`` frames per second.

    The default, PNG frames in a QuickTime container, is lossless (decoded frames equal
    ``frames``) and takes any frame size, as does ``("matroska", "ffv1")`` (a container that
    stores no frame count); ``("mp4", "mpeg4")`` is lossy (YUV 4:2:0) and needs even sides.
    """
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = {"png": "rgb24", "ffv1": "bgr0"}.get(codec, "yuv420p")
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
    return buffer.getvalue()


def hf_decode(file: str | os.PathLike) -> tuple[np.ndarray, dict]:
    """Every frame of ``file`` as HF's own PyAV reader decodes it (``[T, H, W, 3]`` uint8), and
    the metadata HF's processors read (``total_num_frames``, ``fps``)."""
    from transformers.video_utils import load_video

    frames, meta = load_video(str(file), backend="pyav")
    return frames, {"total_num_frames": meta.total_num_frames, "fps": meta.fps}
