"""The preprocessing pool: work runs in other processes, equals in-process preprocessing, errors
come back as ValueError, nothing outlives shutdown; and LLM overlaps it with the engine."""

from __future__ import annotations

import dataclasses
import gc
import io
import os
import struct
import threading
import time
import zlib
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mm_serve import LLM, SamplingParams
from mm_serve.config import EngineArgs
from mm_serve.encoders.image_io import load_image
from mm_serve.encoders.processors import get_image_processor
from mm_serve.preprocess.pool import PreprocessPool
from tests.fixtures.leaks import assert_llm_idle
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

TAG = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def photo(name: str) -> Image.Image:
    if name == "grace_hopper.jpg":
        import matplotlib

        return Image.open(Path(matplotlib.get_data_path()) / "sample_data" / name)
    import skimage

    return Image.open(Path(skimage.__file__).parent / "data" / name)


def jpeg(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def noise(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(pid_alive(p) for p in pids)


@pytest.fixture(scope="module")
def qwen2_vl_path(tmp_path_factory) -> str:
    return build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", seed=3)


@pytest.fixture(scope="module")
def config(qwen2_vl_path):
    return EngineArgs(qwen2_vl_path, max_pixels=500 * 500).create_engine_config()


def test_pool_matches_in_process_preprocessing(config, tmp_path):
    multimodal = dataclasses.replace(config.multimodal, mm_preprocess_workers=2)
    pool = PreprocessPool(config.model, multimodal)
    assert pool.worker_pids() == []  # started lazily
    processor = get_image_processor(config.model.path, config.model.hf_config)
    path = tmp_path / "rocket.jpg"
    path.write_bytes(jpeg(photo("rocket.jpg").resize((300, 200))))
    sources = [
        jpeg(photo("grace_hopper.jpg").resize((256, 300))),
        str(path),
        photo("chelsea.png").convert("L").resize((200, 150)),
        noise(90, 300, 1),
    ]
    try:
        futures = [pool.submit(source) for source in sources]
        for source, future in zip(sources, futures, strict=True):
            result = future.result()
            assert result.pid != os.getpid()
            item = result.to_processed_image()
            expected = processor.preprocess(load_image(source), defer_normalization=True)
            assert torch.equal(item.pixel_values, expected.pixel_values)
            assert (item.pixel_mean, item.pixel_std) == (expected.pixel_mean, expected.pixel_std)
            assert item.num_tokens == expected.num_tokens
            assert item.image_grid_thw == expected.image_grid_thw
        pids = pool.worker_pids()
        assert 1 <= len(pids) <= 2 and os.getpid() not in pids
    finally:
        pool.shutdown()
    assert wait_gone(pids, timeout=0.5)  # shutdown waits for the workers
    pool.shutdown()  # twice is fine
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(sources[0])


def test_start_starts_every_worker_at_once(config):
    multimodal = dataclasses.replace(config.multimodal, mm_preprocess_workers=3)
    pool = PreprocessPool(config.model, multimodal)
    try:
        jobs = pool.start()
        pids = pool.worker_pids()
        assert len(pids) == 3  # all started, none waits for a first image
        assert {job.result(timeout=120) for job in jobs} <= set(pids)
        assert pool.submit(jpeg(noise(40, 40, 8))).result().pid in pids
    finally:
        pool.shutdown()
    assert wait_gone(pids)


def png_header(width: int, height: int) -> bytes:
    """A PNG declaring ``width x height`` RGB whose pixel data (IDAT) is empty."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"")


def test_pool_errors_are_value_errors_and_the_pool_keeps_working(config):
    pool = PreprocessPool(config.model, config.multimodal)
    good = jpeg(photo("coffee.png").resize((120, 80)))
    cases = [
        (b"not an image", "Cannot decode the image data: not an image in a known format"),
        (good[: len(good) // 2], "Cannot decode the image data as an image"),
        (jpeg(noise(600, 600, 2)), r"600x600 = 360000 pixels, above the limit of 250000"),
        # A 45-byte PNG whose header declares 12000x12000: rejected before decoding.
        (png_header(12000, 12000), r"12000x12000 = 144000000 pixels, above the limit"),
    ]
    try:
        for source, message in cases:
            with pytest.raises(ValueError, match=message):
                pool.submit(source).result()
        assert pool.submit(good).result().num_tokens > 0
    finally:
        pool.shutdown()


def test_a_request_of_many_images_takes_turns_with_the_next(config):
    """One worker; request A queues six large images, then request B one small image: B's
    image is handed over after A's second (groups take turns), not after A's sixth (FIFO)."""
    multimodal = dataclasses.replace(
        config.multimodal, mm_preprocess_workers=1, max_pixels=2000 * 2000
    )
    pool = PreprocessPool(config.model, multimodal)
    large = [jpeg(noise(2000, 1500, seed)) for seed in range(6)]
    done: list[str] = []
    try:
        pool.start()[0].result()  # the worker is warm: A's first job starts at once
        group_a, group_b = object(), object()
        futures = [pool.submit(image, group=group_a) for image in large]
        futures.append(pool.submit(jpeg(noise(64, 48, 9)), group=group_b))
        for name, future in zip(["a"] * 6 + ["b"], futures, strict=True):
            future.add_done_callback(lambda _, name=name: done.append(name))
        assert all(future.result().num_tokens > 0 for future in futures)
    finally:
        pool.shutdown()
    assert done == ["a", "a", "b", "a", "a", "a", "a"]


def test_shutdown_cancels_queued_jobs(config):
    multimodal = dataclasses.replace(
        config.multimodal, mm_preprocess_workers=1, max_pixels=2000 * 2000
    )
    pool = PreprocessPool(config.model, multimodal)
    futures = [pool.submit(jpeg(noise(2000, 1500, seed))) for seed in range(4)]
    pool.shutdown()
    assert all(future.done() for future in futures)
    assert any(future.cancelled() for future in futures)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(jpeg(noise(64, 48, 9)))


def image_prompt(image) -> dict:
    return {"prompt": f"{TAG}What is it?", "multi_modal_data": {"image": [image]}}


def assert_no_kv_leak(llm: LLM) -> None:
    assert_llm_idle(llm)


def test_engine_steps_while_the_last_prompt_preprocesses(qwen2_vl_path, monkeypatch):
    """The last image is held back until the engine has stepped: with every prompt validated
    before the engine starts, no step would come first (and the gate's fallback opens it)."""
    llm = LLM(qwen2_vl_path, multiprocess=False)
    events: list[str] = []
    gate = threading.Event()
    last = jpeg(noise(64, 96, 7))
    pool = llm.input_processor.mm_processor.pool
    real_submit = pool.submit

    def gated_submit(source, processor=None, group=None):
        future = real_submit(source, processor, group)
        if source is not last:
            return future
        gated: Future = Future()

        def release():
            gate.wait(timeout=10)
            result = future.result()
            events.append("last image ready")
            gated.set_result(result)

        threading.Thread(target=release, daemon=True).start()
        return gated

    real_step = llm.engine_core.step

    def step():
        events.append("step")
        gate.set()
        return real_step()

    monkeypatch.setattr(pool, "submit", gated_submit)
    monkeypatch.setattr(llm.engine_core, "step", step)
    prompts = ["A text prompt first.", image_prompt(jpeg(photo("coffee.png"))), image_prompt(last)]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert events[0] == "step" and "last image ready" in events
    assert events.index("last image ready") > 0
    monkeypatch.undo()
    alone = llm.generate(image_prompt(last), GREEDY, use_tqdm=False)
    assert outputs[2].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert_no_kv_leak(llm)
    llm.shutdown()


def test_bad_last_prompt_leaves_nothing_behind(qwen2_vl_path):
    llm = LLM(qwen2_vl_path, max_pixels=500 * 500)
    prompts = [
        "Some text.",
        image_prompt(jpeg(photo("coffee.png"))),
        image_prompt(jpeg(noise(600, 600, 3))),  # above max_pixels: fails in the pool
    ]
    with pytest.raises(ValueError, match="max_pixels"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_no_kv_leak(llm)
    assert not llm.output_processor.has_unfinished_requests()
    with pytest.raises(ValueError, match="Cannot decode"):
        llm.generate(prompts[:2] + [image_prompt(b"\xff\xd8 truncated")], GREEDY)
    assert_no_kv_leak(llm)
    outputs = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    assert all(o.outputs[0].token_ids for o in outputs)
    assert_no_kv_leak(llm)
    llm.shutdown()


def test_no_worker_outlives_its_llm(qwen2_vl_path, llama_path):
    text_only = LLM(llama_path)
    assert text_only.input_processor.mm_processor is None  # never starts a pool
    llm = LLM(qwen2_vl_path)
    llm.generate(image_prompt(jpeg(noise(64, 64, 4))), GREEDY, use_tqdm=False)
    pids = llm.input_processor.mm_processor.pool.worker_pids()
    assert pids and all(pid_alive(p) for p in pids)
    llm.shutdown()
    llm.shutdown()
    assert wait_gone(pids, timeout=0.5)
    with pytest.raises(RuntimeError, match="shut down"):  # a new image needs the pool
        llm.generate(image_prompt(jpeg(noise(64, 64, 6))), GREEDY, use_tqdm=False)
    # Garbage collection stops the pool too.
    collected = LLM(qwen2_vl_path)
    collected.generate(image_prompt(jpeg(noise(64, 64, 5))), GREEDY, use_tqdm=False)
    pids = collected.input_processor.mm_processor.pool.worker_pids()
    del collected
    gc.collect()
    assert wait_gone(pids)
