"""The Qwen2-VL video processor against transformers' ``Qwen2VLVideoProcessor``, and the
pieces around it: PyAV decoding, the limits, the content hash, M-RoPE time positions.

Pixels, grids and Qwen2.5-VL's ``second_per_grid_ts`` equal HF's for generated clips (odd
sizes, an odd frame count padded to whole temporal patches, every frame or sampled by fps or
by num_frames), frames given as PIL images, and a real clip shipped by scikit-image; HF gets
the same frames decoded by its own ``read_video_pyav``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from mm_serve.cache.mm_hash import MultiModalHasher
from mm_serve.encoders import video_io
from mm_serve.encoders.qwen2_vl_processor import normalize_patches, patchify
from mm_serve.encoders.qwen2_vl_video_processor import Qwen2VLVideoProcessor
from mm_serve.encoders.video_io import VideoFrames, as_video_source, open_video
from mm_serve.encoders.video_processors import VideoLimits, get_video_processor
from mm_serve.models.mrope import get_mrope_input_positions
from tests.fixtures.qwen_video_cases import real_clip, shapes_clip
from tests.fixtures.video_clips import encode_clip, hf_decode, moving_shapes
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

warnings.filterwarnings("ignore", message=".*per-frame pixel cap.*")


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("video_q25"), "qwen2_5_vl", seed=1)


@pytest.fixture(scope="module")
def hf_processor(path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


@pytest.fixture(scope="module")
def ours(path):
    from transformers import AutoConfig

    return get_video_processor(path, AutoConfig.from_pretrained(path))


def hf_video(hf_processor, frames, metadata: dict | None, kwargs: dict):
    """HF's pixels, grid and second_per_grid_ts (Qwen2.5-VL's processor) for one video."""
    videos_kwargs = dict(kwargs)
    if "fps" in kwargs or "num_frames" in kwargs:
        videos_kwargs["do_sample_frames"] = True
    out = hf_processor(
        text=["<|vision_start|><|video_pad|><|vision_end|>"],
        videos=[frames],
        video_metadata=None if metadata is None else [metadata],
        return_tensors="pt",
        **videos_kwargs,
    )
    return out["pixel_values_videos"], out["video_grid_thw"][0].tolist(), out["second_per_grid_ts"]


def assert_matches(ours_item, hf_pixels, hf_grid, hf_seconds):
    assert list(ours_item.image_grid_thw) == hf_grid
    assert torch.equal(ours_item.pixel_values, hf_pixels)
    # HF's second_per_grid_ts is a float32 tensor of the same Python value.
    assert torch.tensor([ours_item.second_per_grid_t]).equal(hf_seconds)
    assert ours_item.num_tokens == hf_pixels.shape[0] // 4 and ours_item.modality == "video"


@pytest.mark.parametrize(
    "kwargs", [{}, {"fps": 4}, {"fps": 1}, {"num_frames": 6}], ids=["all", "fps4", "fps1", "n6"]
)
def test_clip_pixels_match_hf(tmp_path, hf_processor, ours, kwargs):
    file = shapes_clip(tmp_path)
    frames, metadata = hf_decode(file)
    expected = hf_video(hf_processor, frames, metadata, kwargs)
    processor = ours.with_kwargs(kwargs)
    assert_matches(processor.preprocess(str(file), VideoLimits()), *expected)
    # Deferred: uint8 frames, patchified and normalised later (on the device), same pixels.
    deferred = processor.preprocess(file.read_bytes(), VideoLimits(), defer_normalization=True)
    assert deferred.pixel_values.dtype == torch.uint8 and deferred.pixel_values.dim() == 4
    patches = patchify(deferred.pixel_values, 14, 2, 2)
    assert torch.equal(
        normalize_patches(patches, deferred.pixel_mean, deferred.pixel_std), expected[0]
    )


def test_real_clip_matches_hf(hf_processor, ours):
    frames, metadata = hf_decode(real_clip())
    for kwargs in ({}, {"fps": 5}):
        expected = hf_video(hf_processor, frames, metadata, kwargs)
        assert_matches(
            ours.with_kwargs(kwargs).preprocess(str(real_clip()), VideoLimits()), *expected
        )


def test_frames_given_decoded_match_hf(hf_processor, ours):
    """PIL frames (no frame rate: HF's 24 fps), an array with its fps, a grayscale array."""
    clip = moving_shapes(6, 67, 45, seed=3)
    pil = [Image.fromarray(frame) for frame in clip]
    expected = hf_video(hf_processor, pil, None, {})
    assert_matches(ours.preprocess(as_video_source(pil), VideoLimits()), *expected)
    metadata = {"total_num_frames": 6, "fps": 3.0}
    expected = hf_video(hf_processor, clip, metadata, {"num_frames": 4})
    source = as_video_source((clip, {"fps": 3.0}))
    assert_matches(ours.with_kwargs({"num_frames": 4}).preprocess(source, VideoLimits()), *expected)
    gray = clip[..., :1]
    expected = hf_video(hf_processor, np.repeat(gray, 3, -1), None, {})
    assert_matches(ours.preprocess(as_video_source(gray), VideoLimits()), *expected)


def test_cap_pixels_per_frame_matches_hf():
    from transformers import Qwen2VLVideoProcessor as HFVideoProcessor

    settings = {"cap_pixels_per_frame": True, "max_video_tokens": 40, "min_pixels": 28 * 28}
    hf = HFVideoProcessor(**settings)
    clip = moving_shapes(8, 120, 200, seed=4)
    out = hf(videos=[clip], return_tensors="pt")
    ours = Qwen2VLVideoProcessor.from_config(settings).preprocess(VideoFrames(clip), VideoLimits())
    assert list(ours.image_grid_thw) == out["video_grid_thw"][0].tolist() != [4, 8, 14]
    assert torch.equal(ours.pixel_values, out["pixel_values_videos"])


def test_limits_are_checked_before_decoding(ours, monkeypatch):
    data = encode_clip(moving_shapes(12, 40, 60), fps=8)  # 56 x 84 resized: 6 tokens a patch
    assert ours.with_kwargs({"num_frames": 10}).preprocess(data, VideoLimits(max_frames=10))
    monkeypatch.setattr(video_io._PyAVReader, "frames", None)  # decoding a frame now fails
    with pytest.raises(ValueError, match="12 frames after sampling.*--max-video-frames"):
        ours.preprocess(data, VideoLimits(max_frames=10))
    with pytest.raises(ValueError, match="expands to 36 tokens, more than the 30"):
        ours.preprocess(data, VideoLimits(max_tokens=30))
    with pytest.raises(ValueError, match="above the limit of 1000"):
        ours.preprocess(data, VideoLimits(max_pixels=1000))


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "empty"),
        (b"\x00garbage\xffbytes" * 50, "Cannot decode the video data"),
        (encode_clip(moving_shapes(8, 40, 60))[:300], "Cannot decode the video data"),
    ],
    ids=["empty", "garbage", "truncated"],
)
def test_undecodable_video_is_a_value_error(ours, data, match):
    with pytest.raises(ValueError, match=match):
        ours.preprocess(data, VideoLimits())


def test_sampling_errors(ours):
    frames = VideoFrames(moving_shapes(5, 30, 30))
    with pytest.raises(ValueError, match="frame rate"):
        ours.with_kwargs({"fps": 2}).preprocess(frames, VideoLimits())
    with pytest.raises(ValueError, match="Cannot sample 6 frames of a video of 5"):
        ours.with_kwargs({"num_frames": 6}).preprocess(frames, VideoLimits())
    with pytest.raises(ValueError, match="Unknown mm_processor_kwargs"):
        ours.with_kwargs({"detail": "low"})
    with pytest.raises(ValueError, match="positive"):
        ours.with_kwargs({"fps": 0})
    with pytest.raises(ValueError, match="uint8"):
        as_video_source(np.zeros((2, 8, 8, 3), np.float32))
    with pytest.raises(ValueError, match="one size"):
        as_video_source([Image.new("RGB", (8, 8)), Image.new("RGB", (9, 8))])


def test_frame_count_without_header(tmp_path):
    """A container that stores no frame count (Matroska): its packets are counted."""
    clip = moving_shapes(7, 32, 48)
    data = encode_clip(clip, fps=7, container="matroska", codec="ffv1")
    with open_video(data) as reader:
        assert reader.metadata.total_num_frames == 7 and reader.metadata.fps == 7.0
        assert np.array_equal(np.stack(list(reader.frames([1, 4, 6]))), clip[[1, 4, 6]])


def test_video_hash(tmp_path, ours):
    data = encode_clip(moving_shapes(6, 30, 40), fps=8)
    file = tmp_path / "v.mov"
    file.write_bytes(data)
    hasher = MultiModalHasher("m", ours.hash_kwargs(), seed=1)
    sampled = MultiModalHasher("m", ours.with_kwargs({"fps": 2}).hash_kwargs(), seed=1)
    assert hasher.hash_video(data) == hasher.hash_video(str(file)) == hasher.hash_video(file)
    assert hasher.hash_video(data) != sampled.hash_video(data)  # other frames sampled
    assert hasher.hash_video(data) != hasher.hash_image(data)  # a video is no image
    frames = moving_shapes(6, 30, 40)
    same = hasher.hash_video(VideoFrames(frames.copy()))
    assert (
        same
        == hasher.hash_video(VideoFrames(frames))
        != hasher.hash_video(VideoFrames(frames, 8.0))
    )
    frames[3, 5, 5, 0] ^= 1
    assert hasher.hash_video(VideoFrames(frames)) != same
    assert hasher.hash_video(data, uuid="u") == hasher.hash_video(b"other", uuid="u")


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_mrope_positions_match_hf(tmp_path, family):
    """A prompt of text, an image, text and a video sampled at 2.75 temporal positions per
    temporal patch (Qwen2.5-VL: tokens_per_second 4 x 0.6875 s; Qwen2-VL: consecutive)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    path = build_tiny_vlm_checkpoint(tmp_path, family, seed=2)
    config = AutoConfig.from_pretrained(path)
    hf = AutoModelForImageTextToText.from_config(config)
    processor = get_video_processor(path, config).with_kwargs({"fps": 4})
    video = processor.preprocess(encode_clip(moving_shapes(11, 53, 91), fps=8), VideoLimits())
    assert video.second_per_grid_t == 0.6875
    image_grid, img, vid = (1, 4, 6), config.image_token_id, config.video_token_id
    ids = [5, 6] + [img] * 6 + [7, 8, 9] + [vid] * video.num_tokens + [10, 11]
    ours, delta = get_mrope_input_positions(ids, [image_grid, video], config)
    kinds = torch.tensor([[1 if i == img else 2 if i == vid else 0 for i in ids]])
    kwargs = {"second_per_grid_ts": torch.tensor([0.6875])} if family == "qwen2_5_vl" else {}
    expected, hf_delta = hf.model.get_rope_index(
        torch.tensor([ids]),
        mm_token_type_ids=kinds,
        image_grid_thw=torch.tensor([image_grid]),
        video_grid_thw=torch.tensor([video.image_grid_thw]),
        **kwargs,
    )
    assert torch.equal(ours, expected[:, 0]) and delta == int(hf_delta)
    temporal = ours[0, 11 : 11 + video.num_tokens].unique().tolist()
    # The video starts at position 8 (2 text, the image's 3 = max(4, 6) / 2, 3 text).
    assert temporal == ([8, 10] if family == "qwen2_5_vl" else [8, 9])
    with pytest.raises(ValueError, match=r"Item 1 \(image.*6 image tokens at prompt position 11"):
        get_mrope_input_positions(ids, [image_grid, image_grid], config)


def test_video_crosses_the_wire(ours):
    """A video's modality and seconds per temporal patch travel with its frames to the
    engine core (M-RoPE needs both)."""
    from mm_serve import SamplingParams
    from mm_serve.messages.request import MultiModalFeature, PlaceholderRange, Request
    from mm_serve.messages.wire import InputCodec

    source = VideoFrames(moving_shapes(5, 30, 40), fps=10.0)
    item = ours.preprocess(source, VideoLimits(), defer_normalization=True)
    feature = MultiModalFeature("v", PlaceholderRange(1, item.num_tokens), item)
    request = Request("r", [1] * (item.num_tokens + 2), SamplingParams(), mm_features=[feature])
    codec = InputCodec()
    (decoded,) = codec.decode(codec.encode_request(request))
    data = decoded.mm_features[0].data
    assert (data.modality, data.second_per_grid_t) == ("video", 2 / 10.0)
    assert data.image_grid_thw == item.image_grid_thw == (3, 4, 6)
    assert torch.equal(data.pixel_values, item.pixel_values)


def test_multi_modal_data_video_forms():
    """vLLM's forms: a file, an array, a list of frames or a (frames, metadata) pair is one
    video; a list of those is several."""
    from mm_serve.frontend.processor import Prompt

    clip = moving_shapes(3, 8, 8)
    frames = [Image.fromarray(f) for f in clip]
    one = [b"file", "clip.mp4", clip, frames, list(clip), (clip, {"fps": 2.0})]
    for video in one:
        parsed = Prompt.parse({"prompt": "x", "multi_modal_data": {"video": video}})
        assert len(parsed.videos) == 1
    several = Prompt.parse({"prompt": "x", "multi_modal_data": {"video": [clip, "a.mp4"]}})
    assert len(several.videos) == 2 and several.images is None
    with pytest.raises(ValueError, match="'image' and/or 'video'"):
        Prompt.parse({"prompt": "x", "multi_modal_data": {"audio": b""}})
