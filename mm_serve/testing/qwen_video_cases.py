"""What the Qwen-family video tests share (Qwen2-VL, Qwen2.5-VL and Qwen3-VL take videos alike
in a raw prompt): the placeholders, a chat turn, the clips, and the batch each family's engine
runs against HF.

A case is a dict: ``prompt`` (the text with its placeholders), and optionally ``images``,
``videos`` (paths, bytes or PIL frames), ``hf_videos`` (what HF decodes in place of
``videos``: a path where the engine gets the file's bytes) and ``kwargs`` (the
``mm_processor_kwargs``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mm_serve.testing.images import generated
from mm_serve.testing.video_clips import encode_clip, hf_decode, moving_shapes

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def turn(text: str) -> str:
    """A user turn of the Qwen chat format holding ``text``, then the assistant's opening."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def real_clip() -> Path:
    """24 frames of 25 x 14 pixels at 100/7 fps, from scikit-image."""
    import skimage

    return Path(skimage.__file__).parent / "data" / "no_time_for_that_tiny.gif"


def shapes_clip(folder: Path) -> Path:
    """``folder/shapes.mov``, written: 11 frames of 91 x 53 pixels at 8 fps, lossless (PNG
    frames in a QuickTime file)."""
    file = folder / "shapes.mov"
    file.write_bytes(encode_clip(moving_shapes(11, 53, 91, seed=0), fps=8))
    return file


def clip_fixture() -> Any:
    """The module-scoped pytest fixture ``clip`` (``shapes_clip`` in a temporary folder); a
    test module takes it with ``clip = clip_fixture()``."""
    import pytest

    @pytest.fixture(scope="module")
    def clip(tmp_path_factory: Any) -> Path:
        return shapes_clip(tmp_path_factory.mktemp("clips"))

    return clip


def mixed_video_batch(clip: Path) -> list[dict[str, Any]]:
    """A text-only prompt, ``clip`` by path, ``clip``'s bytes sampled at 4 fps after an image
    of 77 x 45 pixels, 5 PIL frames of 66 x 41 pixels, and ``real_clip`` at 5 fps."""
    frames = [Image.fromarray(f) for f in moving_shapes(5, 41, 66, seed=2)]
    return [
        {"prompt": turn("A text-only question.")},
        {"prompt": turn(f"{VIDEO}What moves?"), "videos": [str(clip)]},
        {
            "prompt": turn(f"{IMAGE}And then {VIDEO}Compare."),
            "images": [generated(77, 45, 5)],
            "videos": [clip.read_bytes()],
            "hf_videos": [str(clip)],
            "kwargs": {"fps": 4},
        },
        {"prompt": turn(f"Frames: {VIDEO}"), "videos": [frames]},
        {"prompt": turn(f"{VIDEO}Describe."), "videos": [str(real_clip())], "kwargs": {"fps": 5}},
    ]


def video_prompt(case: dict[str, Any]) -> dict[str, Any]:
    """``LLM.generate``'s prompt of a ``case``."""
    prompt: dict[str, Any] = {"prompt": case["prompt"]}
    data = {k[:-1]: case[k] for k in ("images", "videos") if case.get(k)}
    if data:
        prompt["multi_modal_data"] = data
    if case.get("kwargs"):
        prompt["mm_processor_kwargs"] = case["kwargs"]
    return prompt


def hf_videos(case: dict[str, Any], stack_frames: bool = False) -> dict[str, Any]:
    """The ``videos`` and ``video_metadata`` HF's processor gets for a ``case``: its
    ``hf_videos`` (else ``videos``), a file decoded by HF's own reader (``hf_decode``, with
    its metadata), frames as they are (``stack_frames``: as one ``[T, H, W, 3]`` array);
    None for none."""
    decoded = []
    for video in case.get("hf_videos", case.get("videos", [])):
        if isinstance(video, (str, Path)):
            decoded.append(hf_decode(video))
        else:
            frames = np.stack([np.asarray(frame) for frame in video]) if stack_frames else video
            decoded.append((frames, None))
    metadata = [meta for _, meta in decoded]
    return {
        "videos": [frames for frames, _ in decoded] or None,
        "video_metadata": metadata if any(metadata) else None,
    }
