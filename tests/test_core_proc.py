"""The engine core in its own process: same outputs as in-process, errors per request, abort,
death detection, clean shutdown, and a wire of msgpack bodies plus raw tensor frames (its life
outside serving: ``test_core_proc_lifetime.py``).

One engine process (a tiny Qwen2-VL) is shared by the module; tests that kill or fail an
engine start their own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from mm_serve import LLM, SamplingParams
from mm_serve.config import EngineArgs
from mm_serve.encoders.base import ProcessedImage
from mm_serve.frontend.core_client import AsyncEngineCoreClient
from mm_serve.frontend.exceptions import EngineDeadError, EngineRequestError
from mm_serve.messages.outputs import EngineCoreOutput
from mm_serve.messages.request import MultiModalFeature, PlaceholderRange, Request
from mm_serve.messages.stats import EngineStats
from mm_serve.messages.wire import (
    EngineCoreOutputs,
    InputCodec,
    KVCacheInfo,
    OutputCodec,
    RequestDecodeError,
)
from tests.fixtures.leaks import shut_down_and_check
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

ENGINE_ARGS = {"num_kv_blocks": 128, "max_model_len": 512}
TAG = "<|vision_start|><|image_pad|><|vision_end|>"
TIMEOUT_S = 60.0
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)


def photo() -> Image.Image:
    import matplotlib

    return Image.open(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg")


def generated(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory) -> str:
    return build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", seed=3)


@pytest.fixture(scope="module")
def llm(vlm_path) -> LLM:
    return LLM(vlm_path, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def client(vlm_path):
    client = AsyncEngineCoreClient(EngineArgs(model=vlm_path, **ENGINE_ARGS).create_engine_config())
    yield client
    shut_down_and_check(client)


def make_requests(llm: LLM, prompts: list, params: SamplingParams, prefix: str) -> list[Request]:
    """Engine requests exactly as ``llm.generate`` builds them (images preprocessed)."""
    requests = []
    for index, prompt in enumerate(prompts):
        processed = llm.input_processor.process(prompt)
        if hasattr(processed, "result"):  # images preprocessed in a pool: wait for them
            processed = processed.result()
        requests += llm.input_processor.make_requests(f"{prefix}{index}", processed, params)
    return requests


async def collect(queue: asyncio.Queue) -> tuple[list[int], float, str]:
    """(token ids, cumulative logprob, finish reason) of one request; raises its error."""
    tokens, cumulative = [], 0.0
    while True:
        item = await asyncio.wait_for(queue.get(), TIMEOUT_S)
        if isinstance(item, BaseException):
            raise item
        tokens += item.new_token_ids
        cumulative += sum(entry[1][0] for entry in item.new_logprobs or [])
        if item.finished:
            return tokens, cumulative, item.finish_reason


async def generate(client, requests: list[Request]) -> list[tuple[list[int], float, str]]:
    queues = [await client.add_request(r) for r in requests]
    return await asyncio.gather(*(collect(q) for q in queues))


def test_greedy_matches_in_process_llm(client, llm):
    prompts = [
        "A text-only question about nothing in particular.",
        {"prompt": f"{TAG}Describe the image.", "multi_modal_data": {"image": [photo()]}},
        {
            "prompt": f"Compare {TAG} with {TAG} please.",
            "multi_modal_data": {"image": [generated(300, 90, 1), photo().convert("L")]},
        },
    ]
    reference = llm.generate(prompts, GREEDY, use_tqdm=False)
    results = asyncio.run(generate(client, make_requests(llm, prompts, GREEDY, "greedy-")))
    for ref, (tokens, cumulative, finish_reason) in zip(reference, results, strict=True):
        completion = ref.outputs[0]
        assert tokens == completion.token_ids
        assert finish_reason == completion.finish_reason
        assert abs(cumulative - completion.cumulative_logprob) < 1e-4
    assert client.engine_info.max_model_len == 512
    assert client.engine_info.vocab_size == llm.config.model.vocab_size


def test_abort_mid_generation_frees_blocks(client, llm):
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    prompt = {"prompt": f"{TAG}Tell me everything.", "multi_modal_data": {"image": [photo()]}}
    (request,) = make_requests(llm, [prompt], long, "abort-")

    async def run():
        queue = await client.add_request(request)
        first = await asyncio.wait_for(queue.get(), TIMEOUT_S)
        assert first.new_token_ids and not first.finished
        await client.abort_requests([request.request_id])
        # The abort is handled before this call: inputs are processed in order.
        kv = await client.get_kv_cache_info()
        stats = await client.get_stats()
        (again,) = make_requests(llm, ["Still serving?"], GREEDY, "after-abort-")
        return kv, stats, await generate(client, [again])

    kv, stats, (after,) = asyncio.run(run())
    assert isinstance(kv, KVCacheInfo) and isinstance(stats, EngineStats)
    assert kv.num_free_blocks == kv.num_blocks == ENGINE_ARGS["num_kv_blocks"]
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0
    assert (
        after[0] == llm.generate("Still serving?", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    )
    assert asyncio.run(client.get_kv_cache_info()).num_free_blocks == kv.num_blocks


def test_bad_requests_fail_alone(client, llm):
    pixels = ProcessedImage(torch.zeros(16, 1176), num_tokens=4, image_grid_thw=(1, 4, 4))
    image_token = llm.config.model.hf_config.image_token_id
    bad = [
        (Request("too-long", [1] * 600, GREEDY), "maximum length"),
        (Request("bad-token", [1, 10**6], GREEDY), "must be in"),
        (
            Request(
                "bad-image",
                [1, 2, 3],
                GREEDY,
                mm_features=[MultiModalFeature("h", PlaceholderRange(2, 4), pixels)],
            ),
            "placeholder",
        ),
        (Request("unfilled", [1, image_token, 3], GREEDY), "no image fills"),
        (
            Request("bad-stop", [1, 2], SamplingParams(temperature=0.0, stop_token_ids=[10**6])),
            "stop_token_ids",
        ),
    ]
    (good,) = make_requests(llm, ["A good one."], GREEDY, "good-")

    async def run():
        queues = [await client.add_request(r) for r, _ in bad]
        good_queue = await client.add_request(good)
        with pytest.raises(ValueError, match="already in flight"):
            await client.add_request(good)
        errors = []
        for queue in queues:
            item = await asyncio.wait_for(queue.get(), TIMEOUT_S)
            errors.append(item)
        return errors, await collect(good_queue)

    errors, (tokens, _, _) = asyncio.run(run())
    for (request, message), error in zip(bad, errors, strict=True):
        assert isinstance(error, EngineRequestError) and error.kind == "invalid_request"
        assert error.request_id == request.request_id and message in str(error)
    assert tokens == llm.generate("A good one.", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert not client.is_dead


def test_wire_is_msgpack_and_raw_frames(llm):
    prompt = {"prompt": f"{TAG}Look.", "multi_modal_data": {"image": [photo()]}}
    (request,) = make_requests(llm, [prompt], GREEDY, "wire-")
    bf16 = ProcessedImage(torch.randn(4, 6).bfloat16(), 2, None)
    request.mm_features.append(MultiModalFeature("bf16", PlaceholderRange(0, 2), bf16))
    frames = [bytes(f) for f in InputCodec().encode_request(request)]
    body = msgspec.msgpack.decode(frames[0])  # a plain msgpack map: no pickle anywhere
    assert body["type"] == "add" and body["request_id"] == "wire-0"
    assert body["sampling_params"]["logprobs"] == 2
    assert len(frames) == 3 and [f["frame"] for f in body["mm_features"]] == [1, 2]
    # The pool's Qwen2-VL patches travel as uint8 with the normalisation left to the engine.
    assert request.mm_features[0].data.pixel_values.dtype == torch.uint8
    assert len(body["mm_features"][0]["pixel_mean"]) == 3
    sent = [f.data.pixel_values for f in request.mm_features]
    assert frames[1] == sent[0].numpy().tobytes()  # raw tensor bytes, not in the body
    (decoded,) = InputCodec().decode(frames)
    for feature, original in zip(decoded.mm_features, request.mm_features, strict=True):
        assert feature.data.pixel_values.dtype == original.data.pixel_values.dtype
        assert torch.equal(feature.data.pixel_values, original.data.pixel_values)
        assert feature.data.image_grid_thw == original.data.image_grid_thw
        assert feature.data.pixel_mean == original.data.pixel_mean
        assert feature.data.pixel_std == original.data.pixel_std
        assert feature.placeholder == original.placeholder
    assert decoded.sampling_params == request.sampling_params
    assert decoded.prompt_token_ids == request.prompt_token_ids
    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput("a", [5], [([5, 7], [-0.1, -2.5], 1)], None, "stop", 7)],
        stats=EngineStats(num_running_reqs=1),
    )
    encoded = OutputCodec().encode(outputs)
    wire = msgspec.msgpack.decode(encoded)["outputs"][0]  # the Struct's fields, in order
    assert wire[:2] == ["a", [5]] and wire[4:6] == ["stop", 7]
    assert OutputCodec().decode(encoded) == outputs


def test_siblings_travel_in_one_message_with_their_images_once(llm):
    """The ``n`` engine requests of an ``n > 1`` request: one body, each image frame once;
    the engine side gets ``n`` requests sharing the prompt and the pixel tensors."""
    prompt = {"prompt": f"{TAG}Look.", "multi_modal_data": {"image": [photo()]}}
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4)
    requests = make_requests(llm, [prompt], params, "sib-")
    frames = [bytes(f) for f in InputCodec().encode_request(*requests)]
    body = msgspec.msgpack.decode(frames[0])
    assert len(frames) == 2 and body["request_id"] == "0_sib-0"
    assert [s[0] for s in body["siblings"]] == ["1_sib-0", "2_sib-0"]
    decoded = InputCodec().decode(frames)
    assert [r.request_id for r in decoded] == [r.request_id for r in requests]
    assert [r.sampling_params for r in decoded] == [r.sampling_params for r in requests]
    assert all(r.mm_features is decoded[0].mm_features for r in decoded)
    assert all(r.prompt_token_ids == requests[0].prompt_token_ids for r in decoded)
    pixels = decoded[0].mm_features[0].data.pixel_values
    assert torch.equal(pixels, requests[0].mm_features[0].data.pixel_values)
    with pytest.raises(ValueError, match="no sibling"):
        InputCodec().encode_request(requests[0], make_requests(llm, ["x"], GREEDY, "other-")[0])
    malformed = {"type": "add", "request_id": "a", "prompt_token_ids": "?", "siblings": [["b"]]}
    with pytest.raises(RequestDecodeError) as info:
        InputCodec().decode([msgspec.msgpack.encode(malformed)])
    assert info.value.request_ids == ["a", "b"]  # each gets its error


def test_killed_engine_fails_in_flight_requests(vlm_path, llm):
    client = AsyncEngineCoreClient(EngineArgs(model=vlm_path, **ENGINE_ARGS).create_engine_config())
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    requests = make_requests(llm, ["One long answer.", "Another long answer."], long, "kill-")

    async def run():
        queues = [await client.add_request(r) for r in requests]
        await asyncio.wait_for(queues[0].get(), TIMEOUT_S)  # generating
        os.kill(client.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for queue in queues:
            item = await asyncio.wait_for(queue.get(), TIMEOUT_S)
            while not isinstance(item, BaseException):  # outputs sent before the kill
                item = await asyncio.wait_for(queue.get(), TIMEOUT_S)
            assert isinstance(item, EngineDeadError)
        return time.monotonic() - killed_at

    assert asyncio.run(run()) < 1.0
    assert client.is_dead
    with pytest.raises(EngineDeadError):
        asyncio.run(client.add_request(make_requests(llm, ["x"], GREEDY, "late-")[0]))
    with pytest.raises(EngineDeadError):
        asyncio.run(client.get_stats())
    shut_down_and_check(client)
