"""vLLM's ``mm_processor_kwargs`` and OpenAI's ``detail: "low"`` at the image processor
(``ImageProcessor.with_kwargs``, ``low_detail``) and the engine options; over HTTP:
test_api_chat_options.py."""

from __future__ import annotations

import pytest

from mm_serve.config import EngineArgs
from mm_serve.encoders.clip_processor import CLIPImageProcessor
from mm_serve.encoders.processors import get_image_processor
from mm_serve.encoders.qwen2_vl_processor import (
    DEFAULT_MAX_PIXELS,
    LOW_DETAIL_MAX_PIXELS,
    Qwen2VLImageProcessor,
)
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint


def test_qwen_with_kwargs_replaces_the_pixel_bounds() -> None:
    base = Qwen2VLImageProcessor(min_pixels=3136, max_pixels=DEFAULT_MAX_PIXELS)
    assert base.with_kwargs({}) is base
    both = base.with_kwargs({"min_pixels": 10_000, "max_pixels": 200_000})
    assert (both.min_pixels, both.max_pixels) == (10_000, 200_000)
    assert (base.min_pixels, base.max_pixels) == (3136, DEFAULT_MAX_PIXELS)  # unchanged
    lowered = base.with_kwargs({"max_pixels": 1000})  # min_pixels follows it down
    assert (lowered.min_pixels, lowered.max_pixels) == (1000, 1000)
    assert lowered.num_tokens(700, 900) < base.num_tokens(700, 900)
    assert lowered.hash_kwargs() != base.hash_kwargs()


@pytest.mark.parametrize(
    ("kwargs", "phrase"),
    [
        ({"max_pixel": 10}, "max_pixel"),
        ({"size": {"longest_edge": 10}}, "size"),
        ({"max_pixels": 0}, "max_pixels"),
        ({"max_pixels": 1.5}, "max_pixels"),
        ({"min_pixels": True}, "min_pixels"),
        ({"min_pixels": 10_000, "max_pixels": 5_000}, "min_pixels"),
        ({"min_pixels": DEFAULT_MAX_PIXELS + 1}, "min_pixels"),
    ],
)
def test_qwen_with_kwargs_rejects(kwargs, phrase) -> None:
    with pytest.raises(ValueError, match=phrase):
        Qwen2VLImageProcessor().with_kwargs(kwargs)


def test_low_detail_caps_qwen_at_448_squared_and_leaves_clip_alone() -> None:
    assert LOW_DETAIL_MAX_PIXELS == 448 * 448
    low = Qwen2VLImageProcessor().low_detail()
    assert low.max_pixels == LOW_DETAIL_MAX_PIXELS and low.max_num_tokens >= 256
    assert low.num_tokens(2000, 2000) == 256
    small = Qwen2VLImageProcessor(min_pixels=784, max_pixels=28 * 28 * 16)
    assert small.low_detail().max_pixels == small.max_pixels  # never raises the budget
    clip = CLIPImageProcessor(num_tokens=16)
    assert clip.low_detail() is clip and clip.with_kwargs({}) is clip
    with pytest.raises(ValueError, match="max_pixels"):
        clip.with_kwargs({"max_pixels": 1000})


def test_engine_mm_processor_kwargs_size_the_largest_image(tmp_path) -> None:
    path = build_tiny_vlm_checkpoint(tmp_path, "qwen2_vl", seed=0)
    processor = get_image_processor(path, _hf_config(path), None, {"max_pixels": 401408})
    assert processor.max_pixels == 401408
    config = EngineArgs(model=path, mm_processor_kwargs={"max_pixels": 401408})
    multimodal = config.create_engine_config().multimodal
    assert multimodal.max_image_tokens == processor.max_num_tokens == 512
    assert multimodal.mm_processor_kwargs == {"max_pixels": 401408}
    with pytest.raises(ValueError, match="max_pixel"):
        EngineArgs(model=path, mm_processor_kwargs={"max_pixel": 1}).create_engine_config()


def _hf_config(path: str):
    from mm_serve.checkpoint.hub import load_hf_config

    return load_hf_config(path)
