"""Videos through the offline engine against HF transformers, for Qwen2-VL and Qwen2.5-VL.

Greedy tokens equal HF's ``generate`` (top-5 log-probs within 1e-4, float32) for a batch
mixing a text-only prompt, a generated clip (odd size, odd frame count: every frame), a clip
sampled by fps next to an image in one prompt (Qwen2.5-VL: time positions 2.75 apart), a video
given as PIL frames, and a real clip shipped by scikit-image; whole, and with a 8-token budget
that cuts the videos across chunks. HF gets the same frames decoded by its own
``read_video_pyav``. A repeated video hits the processor and encoder caches; a chat turn
with a video part expands as HF's processor does. No KV block or encoder-cache entry is left.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from mm_serve import SamplingParams
from tests.fixtures import family_checks as checks
from tests.fixtures import qwen_video_cases as cases
from tests.fixtures.leaks import assert_llm_idle
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

warnings.filterwarnings("ignore", message=".*per-frame pixel cap.*")


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def path(request, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp(request.param)
    return build_tiny_vlm_checkpoint(folder, request.param, seed=7)


@pytest.fixture(scope="module")
def reference(path) -> checks.HFReference:
    return checks.HFReference.load(path, nested_images=False)


clip = cases.clip_fixture()


def hf_greedy(reference: checks.HFReference, case: dict[str, Any]) -> checks.HFGreedy:
    kwargs = dict(case.get("kwargs") or {})
    if "fps" in kwargs or "num_frames" in kwargs:
        kwargs["do_sample_frames"] = True
    images = case.get("images") or []
    return reference.greedy(
        case["prompt"],
        images,
        max_new_tokens=cases.MAX_NEW_TOKENS,
        **cases.hf_videos(case),
        **kwargs,
    )


@checks.whole_and_chunked(budget=8)
def test_greedy_matches_hf(path, reference, clip, engine_args):
    with checks.running_llm(path, **engine_args) as llm:
        cases.assert_matches_hf(llm, reference, cases.mixed_video_batch(clip), hf_greedy)


def test_repeated_video_hits_the_caches(path, reference, clip):
    """The same clip behind another text: no preprocessing (processor cache) and no tower run
    (encoder cache) the second time, and still HF's tokens."""
    # In process (multiprocess=False): its scheduler inspectable on CUDA too.
    with checks.running_llm(path, block_size=4, multiprocess=False) as llm:
        encoder = llm.engine_core.scheduler.encoder_cache_manager
        processor_cache = llm.input_processor.mm_processor.cache
        cache_hits = processor_cache.hits
        second = cases.assert_encoder_cache_hit(llm, reference, clip, hf_greedy)
        assert processor_cache.hits == cache_hits + 1  # the second's: bytes and path hash alike
        hits = encoder.hits
        sampled = {**second, "kwargs": {"num_frames": 4}}  # other frames: another video
        cases.assert_matches_hf(llm, reference, [sampled], hf_greedy)
        assert encoder.hits == hits


def test_chat_with_video_part(path, reference, clip):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video", "video": str(clip)},
                {"type": "video_url", "video_url": {"url": f"file://{clip}"}},
                {"type": "text", "text": "Same?"},
            ],
        }
    ]
    with checks.running_llm(path) as llm:
        checks.assert_chat_matches_hf(
            llm,
            messages,
            reference.processor,
            lambda text: hf_greedy(reference, {"prompt": text, "videos": [str(clip), str(clip)]}),
            cases.MAX_NEW_TOKENS,
        )


def test_bad_videos_are_value_errors(path, clip):
    """Offline, a bad video raises ValueError naming the problem; the engine serves on."""
    with checks.running_llm(path, max_video_frames=8) as llm:
        bad = [
            ({"video": b"\x00not a video\xff" * 20}, "Cannot decode the video"),
            ({"video": str(clip)}, "11 frames after sampling.*limit of 8"),
            ({"video": [str(clip), str(clip)]}, "1 video placeholders but 2 videos"),
            ({"image": [], "video": "/nonexistent.mp4"}, "not found"),
        ]
        prompt = cases.turn(cases.VIDEO)
        for data, match in bad:
            with pytest.raises(ValueError, match=match):
                llm.generate({"prompt": prompt, "multi_modal_data": data}, use_tqdm=False)
        ok = {"prompt": prompt, "multi_modal_data": {"video": str(clip)}}
        ok["mm_processor_kwargs"] = {"num_frames": 8}
        (output,) = llm.generate(ok, SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 2
        assert_llm_idle(llm)
