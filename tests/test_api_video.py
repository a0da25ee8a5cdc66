"""Videos through a real server (``mm-serve serve``): ``video_url`` parts as data URLs and
allowed local files give HF's greedy tokens; a bad video (undecodable bytes, bad base64, more
frames than ``--max-video-frames``, more videos than ``--limit-mm-per-prompt``, a disallowed
URL) is an OpenAI-style 400 after which the server serves on; nothing is held afterwards."""

from __future__ import annotations

import base64
import time
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from test_api_bad_input import CHAT, assert_error, held

from tests.fixtures.hf_reference import hf_greedy_generate
from tests.fixtures.server import RemoteServer
from tests.fixtures.video_clips import encode_clip, hf_decode, moving_shapes
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

warnings.filterwarnings("ignore", message=".*per-frame pixel cap.*")

MAX_VIDEO_FRAMES = 12
MAX_TOKENS = 6


def video_url(url: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url}}


def data_url(data: bytes, mime: str = "video/quicktime") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat(*parts: dict[str, Any], text: str = "What moves?") -> dict[str, Any]:
    content = [*parts, {"type": "text", "text": text}]
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, Path]:
    """Under the allowed folder: 11 frames (served) and 20 frames (above the limit)."""
    base = tmp_path_factory.mktemp("video_media")
    (base / "root").mkdir()
    files = {
        "short": base / "root" / "short.mov",
        "long": base / "root" / "long.mov",
        "outside": base / "outside.mov",
    }
    files["short"].write_bytes(encode_clip(moving_shapes(11, 53, 91, seed=0), fps=8))
    files["long"].write_bytes(encode_clip(moving_shapes(20, 40, 40, seed=1), fps=8))
    files["outside"].write_bytes(files["short"].read_bytes())
    return files


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("api_video"), "qwen2_5_vl", seed=8)


@pytest.fixture(scope="module")
def http(path, clips):
    args = ["--max-model-len", "512", "--num-kv-blocks", "64", "--mm-preprocess-workers", "1"]
    args += ["--limit-mm-per-prompt", '{"image": 2, "video": 1}']
    args += ["--max-video-frames", str(MAX_VIDEO_FRAMES)]
    args += ["--allowed-local-media-path", str(clips["short"].parent)]
    args += ["--allowed-media-domains", "videos.allowed.test"]
    with RemoteServer(path, args) as server, httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def send(http):
    """POSTs a chat body to the served model."""
    model = http.get("/v1/models").json()["data"][0]["id"]
    return lambda body: http.post(CHAT, json={**body, "model": model})


def hf_reference(path: str, clip: Path) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy ids) of HF for the chat of ``chat(video)`` with ``clip``."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    messages = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    frames, metadata = hf_decode(clip)
    inputs = processor(text=[text], videos=[frames], video_metadata=[metadata], return_tensors="pt")
    prompt_ids, tokens, _ = hf_greedy_generate(model, inputs, MAX_TOKENS)
    return prompt_ids, tokens


def test_video_url_matches_hf(send, path, clips):
    prompt_ids, tokens = hf_reference(path, clips["short"])
    for url in (data_url(clips["short"].read_bytes()), f"file://{clips['short']}"):
        response = send(chat(video_url(url)))
        assert response.status_code == 200, response.text[:500]
        reply = response.json()
        assert reply["prompt_token_ids"] == prompt_ids
        assert reply["choices"][0]["token_ids"] == tokens


BAD = [
    ("garbage", lambda c: chat(video_url(data_url(b"\x00\x01 not a video " * 40))), "decode"),
    ("bad_base64", lambda c: chat(video_url("data:video/mp4;base64,@@@")), "base64"),
    ("too_many_frames", lambda c: chat(video_url(f"file://{c['long']}")), "--max-video-frames"),
    (
        "two_videos",
        lambda c: chat(video_url(f"file://{c['short']}"), video_url(f"file://{c['short']}")),
        "at most 1 videos",
    ),
    ("outside_folder", lambda c: chat(video_url(f"file://{c['outside']}")), "outside"),
    ("host", lambda c: chat(video_url("http://elsewhere.test/v.mp4")), "not allowed"),
    ("missing_file", lambda c: chat(video_url(f"file://{c['short']}.gone")), "does not exist"),
    (
        "sampling_kwargs",
        lambda c: chat(video_url(f"file://{c['short']}")) | {"mm_processor_kwargs": {"fps": -1}},
        "positive",
    ),  # fmt: skip
]


@pytest.mark.parametrize("make, phrase", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_video_is_a_400_and_the_server_serves_on(send, clips, make, phrase):
    assert_error(send(make(clips)), (400,), phrase)
    ok = send(chat(video_url(f"file://{clips['long']}")) | {
        "mm_processor_kwargs": {"num_frames": 8}})  # fmt: skip
    assert ok.status_code == 200, ok.text[:500]
    assert ok.json()["usage"]["completion_tokens"] == MAX_TOKENS


def test_nothing_held_afterwards(http):
    deadline = time.monotonic() + 10
    while any((now := held(http)).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(now.values()), now
