"""``num_cached_images``: how many of a prompt's images were not encoded for it (encoder-cache
hit, or their whole placeholder range in the prefix cache). The web page's "image from cache"
label reads it from ``usage.prompt_tokens_details.cached_images``.

Hand-built requests through the scheduler, as in test_encoder_scheduling.py.
"""

from __future__ import annotations

from test_encoder_scheduling import drain, image_prompt, make_scheduler
from test_scheduler import make_request, run_step

from mm_serve.frontend.output_processor import ParentRequest
from mm_serve.messages.outputs import EngineCoreOutput

LAYOUT = [2, ("cat", 10), 4]  # 16 tokens, 4 full blocks; the image ends on a block edge


def cached_images(scheduler, request_id: str) -> int:
    """Run steps until ``request_id`` samples a token; the count its outputs report."""
    for _ in range(20):
        _, outputs = run_step(scheduler)
        for output in outputs:
            if output.request_id == request_id and output.new_token_ids:
                return output.num_cached_images
    raise AssertionError(f"{request_id} sampled nothing")


def test_encoded_image_is_not_cached_and_a_text_prompt_has_none():
    scheduler = make_scheduler(encoder_budget=16, cache_size=16)
    scheduler.add_request(image_prompt("first", LAYOUT))
    assert cached_images(scheduler, "first") == 0
    scheduler.add_request(make_request("text", 20))
    assert cached_images(scheduler, "text") == 0


def test_encoder_cache_hit_counts_even_in_the_same_step():
    scheduler = make_scheduler(encoder_budget=16, cache_size=16)
    scheduler.add_request(image_prompt("first", LAYOUT))
    scheduler.add_request(image_prompt("second", LAYOUT, text=100))  # other text, same image
    _, outputs = run_step(scheduler)
    assert {o.request_id: o.num_cached_images for o in outputs} == {"first": 0, "second": 1}


def test_prefix_hit_counts_only_when_it_covers_the_whole_image():
    scheduler = make_scheduler(encoder_budget=16, cache_size=16)
    scheduler.add_request(image_prompt("first", [2, ("cat", 12)]))
    drain(scheduler)
    scheduler.add_request(image_prompt("evict", [1, ("dog", 16)]))  # "cat" leaves the encoder
    drain(scheduler)
    # Blocks 0-2 hit (12 tokens) but the image spans 2..14: it is encoded again.
    scheduler.add_request(image_prompt("partial", [2, ("cat", 12), 6]))
    assert cached_images(scheduler, "partial") == 0
    scheduler.add_request(image_prompt("evict2", [1, ("dog", 16)]))
    drain(scheduler)
    # The same 20 tokens again: 4 of 5 blocks hit (16 tokens), the image's KV is all there.
    scheduler.add_request(image_prompt("whole", [2, ("cat", 12), 6]))
    assert cached_images(scheduler, "whole") == 1
    assert "cat" not in scheduler.encoder_cache_manager.cached  # not encoded, not looked up


def test_two_images_one_cached_and_the_count_survives_preemption():
    scheduler = make_scheduler(encoder_budget=16, cache_size=32)
    scheduler.add_request(image_prompt("warm", [1, ("a", 8), 1]))
    drain(scheduler)  # "a" stays in the encoder cache (freeable)
    request = image_prompt("two", [2, ("a", 8), 2, ("b", 8), 2], max_tokens=8)
    scheduler.add_request(request)
    assert cached_images(scheduler, "two") == 1
    scheduler._preempt(scheduler.running.pop())  # resumes with both images cached
    assert cached_images(scheduler, "two") == 1  # as first counted


def test_parent_takes_the_first_childs_images_and_the_most_cached_tokens():
    # n > 1: the siblings hit the embeddings the first child computes; that is no cache hit
    # for the user's request.
    parent = ParentRequest("r", None, [1, 2, 3], num_children=2)
    parent.record_cache_hits(
        1, EngineCoreOutput("r-1", [7], num_cached_tokens=0, num_cached_images=1)
    )
    parent.record_cache_hits(0, EngineCoreOutput("r-0", [7], num_cached_tokens=16))
    assert (parent.num_cached_tokens, parent.num_cached_images) == (16, 0)
