"""Qwen3-VL videos against HF transformers on the tiny Qwen3-VL checkpoint.

The processor: pixels, grids and the placeholder's tokens (each temporal patch's ``<t
seconds>`` text, vision start, video tokens, vision end) equal ``Qwen3VLProcessor``'s for a
generated clip (default 2 frames a second, by fps, by num_frames, more frames than the clip
has, the per-frame pixel cap), frames given decoded (no frame rate: HF's 24) and a real clip
shipped by scikit-image; HF gets the same frames decoded by its own PyAV reader. M-RoPE
positions equal ``Qwen3VLModel.get_rope_index`` (each temporal patch placed as a one-frame
image after its time text). The engine: greedy tokens and top-5 log-probs equal HF's
``generate`` for a batch mixing a text-only prompt, a video, a video next to an image, frames
given decoded and the real clip, whole and with an 8-token budget that cuts the videos (their
text rows and DeepStack columns) across chunks; a chat turn's video parts expand as HF's; a
repeated video hits the encoder cache. No KV block or encoder-cache entry is left.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import pytest
import torch
from PIL import Image

from mm_serve.encoders.video_io import as_video_source
from mm_serve.encoders.video_processors import VideoLimits, get_video_processor
from mm_serve.models.mrope import get_mrope_input_positions
from mm_serve.models.qwen2_vl import pixels_on_device
from tests.fixtures import family_checks as checks
from tests.fixtures.images import generated
from tests.fixtures.qwen_video_cases import (
    IMAGE,
    MAX_NEW_TOKENS,
    VIDEO,
    assert_encoder_cache_hit,
    assert_matches_hf,
    clip_fixture,
    mixed_video_batch,
    qwen3_hf_greedy,
    qwen3_hf_inputs,
    real_clip,
    turn,
)
from tests.fixtures.video_clips import moving_shapes

warnings.filterwarnings("ignore", message=".*per-frame pixel cap.*")

path, reference = checks.checkpoint_fixtures("qwen3_vl", seed=5, nested_images=False)


clip = clip_fixture()


@pytest.fixture(scope="module")
def ours(path):
    return get_video_processor(path, checks.hf_config(path))


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"fps": 4}, {"fps": 1}, {"num_frames": 6}, {"num_frames": 14}],
    ids=["default", "fps4", "fps1", "n6", "n14_repeats"],
)
def test_clip_matches_hf(reference, ours, clip, kwargs):
    """Pixels, grid and placeholder tokens equal HF's; the uint8 frames the pool sends give
    the same patches on the device."""
    case = {"prompt": VIDEO, "videos": [str(clip)], "kwargs": kwargs}
    expected = qwen3_hf_inputs(reference, case)
    processor = ours.with_kwargs(kwargs)
    item = processor.preprocess(str(clip), VideoLimits())
    assert_item_matches(item, expected)
    deferred = processor.preprocess(clip.read_bytes(), VideoLimits(), defer_normalization=True)
    assert deferred.pixel_values.dtype == torch.uint8 and deferred.token_ids == item.token_ids
    vision = reference.model.config.vision_config
    on_device = pixels_on_device([deferred], torch.device("cpu"), vision)
    assert torch.equal(on_device, expected["pixel_values_videos"])


def assert_item_matches(item: Any, expected: Any) -> None:
    """``item`` (one video) equals HF's processor output ``expected`` for ``VIDEO`` alone."""
    assert list(item.image_grid_thw) == expected["video_grid_thw"][0].tolist()
    assert torch.equal(item.pixel_values, expected["pixel_values_videos"])
    ids = expected["input_ids"][0].tolist()
    assert list(item.token_ids) == ids[1:-1] and item.num_tokens == len(ids) - 2
    assert item.modality == "video"


def test_real_clip_and_decoded_frames_match_hf(reference, ours):
    for kwargs in ({}, {"fps": 5}):
        case = {"prompt": VIDEO, "videos": [str(real_clip())], "kwargs": kwargs}
        item = ours.with_kwargs(kwargs).preprocess(str(real_clip()), VideoLimits())
        assert_item_matches(item, qwen3_hf_inputs(reference, case))
    frames = [Image.fromarray(f) for f in moving_shapes(5, 41, 66, seed=2)]
    item = ours.preprocess(as_video_source(frames), VideoLimits())
    assert_item_matches(item, qwen3_hf_inputs(reference, {"prompt": VIDEO, "videos": [frames]}))


def test_cap_pixels_per_frame_matches_hf(reference, ours):
    """The per-frame cap (qwen-vl-utils'): each frame at most ``max_video_tokens`` patches."""
    frames = moving_shapes(8, 120, 200, seed=4)
    capped = dataclasses.replace(ours, cap_pixels_per_frame=True, max_video_tokens=6)
    item = capped.with_kwargs({"num_frames": 8}).preprocess(as_video_source(frames), VideoLimits())
    hf = copy.deepcopy(reference.processor)  # HF reads max_video_tokens off the instance
    hf.video_processor.cap_pixels_per_frame, hf.video_processor.max_video_tokens = True, 6
    expected = hf(text=[VIDEO], videos=[frames], fps=None, num_frames=8, return_tensors="pt")
    uncapped = ours.with_kwargs({"num_frames": 8}).preprocess(
        as_video_source(frames), VideoLimits()
    )
    assert item.image_grid_thw != uncapped.image_grid_thw
    assert_item_matches(item, expected)


def test_too_short_a_video_is_a_value_error(ours):
    with pytest.raises(ValueError, match="1 frame.*at least 2"):
        ours.preprocess(as_video_source(moving_shapes(1, 40, 40)), VideoLimits())


def test_mrope_positions_match_hf(reference, ours, clip):
    """Text, an image, text, a video of 3 temporal patches (each after its time text),
    text: every position and the decode delta equal HF's ``get_rope_index``."""
    case = {
        "prompt": turn(f"{IMAGE}then{VIDEO}ok"),
        "images": [generated(77, 45, 5)],
        "videos": [str(clip)],
        "kwargs": {"fps": 4},
    }
    hf = qwen3_hf_inputs(reference, case)
    video = ours.with_kwargs({"fps": 4}).preprocess(str(clip), VideoLimits())
    assert video.image_grid_thw[0] == 3
    image_grid = tuple(hf["image_grid_thw"][0].tolist())
    ids = hf["input_ids"][0].tolist()
    positions, delta = get_mrope_input_positions(ids, [image_grid, video], reference.model.config)
    expected, hf_delta = reference.model.model.get_rope_index(
        hf["input_ids"],
        mm_token_type_ids=hf["mm_token_type_ids"],
        image_grid_thw=hf["image_grid_thw"],
        video_grid_thw=hf["video_grid_thw"],
    )
    assert torch.equal(positions, expected[:, 0]) and delta == int(hf_delta)


@checks.whole_and_chunked(budget=8)
def test_greedy_matches_hf(path, reference, clip, engine_args):
    with checks.running_llm(path, **engine_args) as llm:
        assert_matches_hf(llm, reference, mixed_video_batch(clip), qwen3_hf_greedy)


def test_repeated_video_hits_the_encoder_cache(path, reference, clip):
    """The same clip behind another text: its embeddings (text rows included) come from the
    encoder cache, and the tokens are still HF's."""
    with checks.running_llm(path, block_size=4, multiprocess=False) as llm:
        encoded = checks.record_encoded_images(llm)
        assert_encoder_cache_hit(llm, reference, clip, qwen3_hf_greedy)
        assert len(encoded) == 1


def test_chat_with_video_part(path, reference, clip):
    """A chat turn's video parts expand as HF's processor expands the chat template's."""
    parts = [
        {"type": "video", "video": str(clip)},
        {"type": "video_url", "video_url": {"url": f"file://{real_clip()}"}},
        {"type": "text", "text": "Same?"},
    ]
    messages = [{"role": "user", "content": parts}]
    videos = [str(clip), str(real_clip())]
    with checks.running_llm(path) as llm:
        checks.assert_chat_matches_hf(
            llm,
            messages,
            reference.processor,
            lambda text: qwen3_hf_greedy(reference, {"prompt": text, "videos": videos}),
            MAX_NEW_TOKENS,
        )
