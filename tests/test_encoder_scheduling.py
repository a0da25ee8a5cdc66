"""Encoder work scheduled like tokens: budgets, chunks cut before images, cache and prefix hits.

Hand-built requests and hand-made runner outputs (no model), as in test_scheduler.py.
"""

from __future__ import annotations

import pytest
from test_scheduler import BLOCK, assert_all_blocks_free, make_request, run_step

from mm_serve.config import CacheConfig, SchedulerConfig
from mm_serve.messages.request import MultiModalFeature, PlaceholderRange, Request
from mm_serve.messages.sampling_params import SamplingParams
from mm_serve.sched.scheduler import Scheduler

IMAGE_TOKEN = 999


def make_scheduler(encoder_budget, cache_size, budget=64, num_blocks=64, chunked=True):
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=8,
        max_model_len=256,
        enable_chunked_prefill=chunked,
        max_num_encoder_input_tokens=encoder_budget,
        encoder_cache_size=cache_size,
    )
    return Scheduler(config, CacheConfig(block_size=BLOCK), num_blocks)


def image_prompt(req_id: str, layout: list, max_tokens: int = 4, text: int = 0) -> Request:
    """``layout``: ints are runs of text tokens (ids ``text + position``), (mm_hash, length)
    pairs are images."""
    tokens, features = [], []
    for item in layout:
        if isinstance(item, int):
            tokens += [text + len(tokens) + t for t in range(item)]
        else:
            mm_hash, length = item
            features.append(MultiModalFeature(mm_hash, PlaceholderRange(len(tokens), length)))
            tokens += [IMAGE_TOKEN] * length
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(req_id, tokens, params, mm_features=features)


def encoded_hashes(scheduler: Scheduler, out) -> list[str]:
    """The mm_hashes a step encodes (for requests still known to the scheduler)."""
    return [
        scheduler.requests[r].mm_features[i].mm_hash
        for r, ids in out.scheduled_encoder_inputs.items()
        for i in ids
    ]


def assert_idle(scheduler: Scheduler) -> None:
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(scheduler)
    encoder = scheduler.encoder_cache_manager
    assert all(not refs for refs in encoder.cached.values())
    assert encoder.num_freeable_slots == encoder.cache_size


def drain(scheduler: Scheduler, max_steps: int = 100) -> None:
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return
        run_step(scheduler)
    raise AssertionError("requests did not finish")


def test_six_image_prompt_spreads_encoder_work_while_decode_continues():
    scheduler = make_scheduler(encoder_budget=8, cache_size=16)
    scheduler.add_request(make_request("chat", 3, first_token=500, max_tokens=40))
    run_step(scheduler)  # "chat" has its prompt done and decodes from now on
    layout = [2]
    for i in range(6):
        layout += [(f"img{i}", 8), 2]
    doc = image_prompt("doc", layout)
    scheduler.add_request(doc)
    encoder_steps = []
    while doc.num_computed_tokens < doc.num_prompt_tokens:
        chat_before = scheduler.requests["chat"].num_output_tokens
        out, _ = run_step(scheduler)
        assert out.num_scheduled_tokens["chat"] == 1
        assert scheduler.requests["chat"].num_output_tokens == chat_before + 1
        encoded = [doc.mm_features[i] for i in out.scheduled_encoder_inputs.get("doc", [])]
        assert sum(f.placeholder.length for f in encoded) <= 8  # the encoder budget
        if encoded:
            encoder_steps.append([f.mm_hash for f in encoded])
        # The chunk always stops right before the first image not yet encoded.
        done = sum(encoder_steps, [])
        waiting = [f for f in doc.mm_features if f.mm_hash not in done]
        if waiting:
            assert doc.num_computed_tokens == waiting[0].placeholder.offset
    assert encoder_steps == [[f"img{i}"] for i in range(6)]
    assert scheduler.encoder_cache_manager.num_encoder_tokens == 48
    drain(scheduler)
    assert_idle(scheduler)


def test_cache_space_holds_the_chunk_until_an_entry_is_released():
    # Room for one image: the second waits until the first is fully computed.
    scheduler = make_scheduler(encoder_budget=64, cache_size=8, budget=12)
    scheduler.add_request(image_prompt("r", [2, ("a", 8), 1, ("b", 8), 1]))
    out, _ = run_step(scheduler)
    assert encoded_hashes(scheduler, out) == ["a"]
    assert out.num_scheduled_tokens == {"r": 11}  # stops before "b" (offset 11)
    out, _ = run_step(scheduler)
    assert encoded_hashes(scheduler, out) == ["b"]
    assert out.free_encoder_mm_hashes == ["a"]  # evicted to make room, told to the runner
    drain(scheduler)
    assert_idle(scheduler)


def test_same_image_encoded_once_and_prefix_hit_skips_the_encoder():
    scheduler = make_scheduler(encoder_budget=16, cache_size=16)
    layout = [2, ("cat", 10), 4]  # 16 tokens, 4 full blocks; the image ends on a block edge
    scheduler.add_request(image_prompt("first", layout))
    scheduler.add_request(image_prompt("second", layout, text=100))  # other text, same image
    out, _ = run_step(scheduler)
    # Both in one step: the image is encoded once, the second request hits the cache.
    assert encoded_hashes(scheduler, out) == ["cat"]
    encoder = scheduler.encoder_cache_manager
    assert (encoder.misses, encoder.hits) == (1, 1)
    drain(scheduler)
    # Evict "cat" from the encoder cache with another image, then send the prompt again:
    # its KV blocks are cached, and the prefix hit covers the whole image: no encoding.
    scheduler.add_request(image_prompt("other", [1, ("dog", 16)]))
    drain(scheduler)
    assert "cat" not in encoder.cached
    scheduler.add_request(image_prompt("third", layout))
    out, _ = run_step(scheduler)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12
    assert out.scheduled_encoder_inputs == {}
    assert "cat" not in encoder.cached
    drain(scheduler)
    assert_idle(scheduler)


def test_prefix_hit_ending_inside_an_image_encodes_it():
    scheduler = make_scheduler(encoder_budget=16, cache_size=16)
    scheduler.add_request(image_prompt("first", [2, ("cat", 12)]))
    drain(scheduler)
    scheduler.add_request(image_prompt("evict", [1, ("dog", 16)]))
    drain(scheduler)
    # Same text and image, then text: blocks 0-2 hit (12 tokens), the image spans 2..14.
    scheduler.add_request(image_prompt("again", [2, ("cat", 12), 6]))
    out, _ = run_step(scheduler)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12
    assert encoded_hashes(scheduler, out) == ["cat"]
    drain(scheduler)
    assert_idle(scheduler)


def test_preempted_and_aborted_requests_release_their_images():
    scheduler = make_scheduler(encoder_budget=16, cache_size=16, budget=8)
    scheduler.add_request(image_prompt("r", [2, ("a", 8), 40]))
    run_step(scheduler)
    encoder = scheduler.encoder_cache_manager
    assert encoder.cached["a"] == {"r"}
    scheduler._preempt(scheduler.running.pop())
    assert encoder.cached["a"] == set()
    out, _ = run_step(scheduler)  # resumed: the cached embeddings are reused
    assert out.scheduled_encoder_inputs == {} and encoder.hits == 1
    scheduler.finish_requests(["r"], status=scheduler.requests["r"].status.FINISHED_ABORTED)
    assert_idle(scheduler)


def test_image_larger_than_encoder_budget_is_rejected():
    scheduler = make_scheduler(encoder_budget=8, cache_size=16)
    with pytest.raises(ValueError, match="encoder budget"):
        scheduler.add_request(image_prompt("big", [1, ("x", 9)]))
    unchunked = make_scheduler(encoder_budget=16, cache_size=16, chunked=False, budget=128)
    with pytest.raises(ValueError, match="encoder budget"):
        unchunked.add_request(image_prompt("two", [1, ("x", 9), 1, ("y", 9)]))
    assert_idle(scheduler)
    assert_idle(unchunked)


def test_without_chunked_prefill_a_prompt_waits_for_all_its_images():
    scheduler = make_scheduler(encoder_budget=16, cache_size=16, chunked=False, budget=128)
    scheduler.add_request(image_prompt("a", [1, ("x", 8), 1]))
    scheduler.add_request(image_prompt("b", [1, ("y", 8), 1, ("z", 8), 1]))
    out, _ = run_step(scheduler)
    # "b" does not fit the rest of the encoder budget, and is never cut into chunks.
    assert out.num_scheduled_tokens == {"a": 10}
    out, _ = run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 1, "b": 19}
    drain(scheduler)
    assert_idle(scheduler)
