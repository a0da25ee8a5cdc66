"""The multimodal caches end to end on tiny VLMs: same tokens as HF with every cache on or off,
KV blocks shared only where the content is the same, and each image encoded once."""

from __future__ import annotations

import pytest
from test_vlm_vs_hf import PLACEHOLDER, HFVisionReference, generated, photo

from mm_serve import LLM, SamplingParams
from tests.fixtures.leaks import assert_llm_idle
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

MAX_NEW_TOKENS = 8
CACHES_OFF = {"enable_prefix_caching": False, "mm_processor_cache_gb": 0}


@pytest.fixture(scope="module", params=["qwen2_vl", "llava"])
def vlm(request, tmp_path_factory):
    family = request.param
    path = build_tiny_vlm_checkpoint(tmp_path_factory.mktemp(family), family=family, seed=5)
    return family, path


def cases(family: str) -> list[tuple[str, list]]:
    """Repeated images and repeated prefixes; the third prompt diverges from the first right
    after the image, so its prefix-cache hit ends inside the image."""
    tag = PLACEHOLDER[family]
    hopper, noise = photo("grace_hopper"), generated(120, 90, 7)
    return [
        (f"{tag}Describe the image.", [hopper]),
        (f"Two pictures: {tag} and {tag}.", [noise, hopper]),
        (f"{tag}What colour is it?", [hopper]),
        (f"{tag}Describe the image.", [noise]),
    ]


def run(llm: LLM, prompts: list[tuple[str, list]]):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    requests = [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts]
    return llm.generate(requests, params, use_tqdm=False)


def first_image_range(llm: LLM, output) -> tuple[int, int]:
    image_token = llm.config.model.hf_config.image_token_id
    ids = output.prompt_token_ids
    start = ids.index(image_token)
    end = start
    while end < len(ids) and ids[end] == image_token:
        end += 1
    return start, end


def test_tokens_equal_hf_with_caches_on_and_off(vlm):
    family, path = vlm
    reference = HFVisionReference(path)
    prompts = cases(family)
    expected = [reference.greedy(text, images)[1][:MAX_NEW_TOKENS] for text, images in prompts]
    for engine_args in ({}, CACHES_OFF):
        # Small steps and blocks: images are cut across chunks and blocks.
        llm = LLM(path, block_size=4, max_num_batched_tokens=24, max_num_seqs=2, **engine_args)
        # Twice: the second pass finds the first pass's KV blocks and embeddings cached.
        passes = [run(llm, prompts) for _ in range(2)]
        for outputs in passes:
            assert [o.outputs[0].token_ids for o in outputs] == expected
        stats = llm.get_stats()
        if engine_args:
            assert stats.prefix_cache_hits == 0 and stats.processor_cache_hits == 0
        else:
            assert stats.prefix_cache_hits > 0 and stats.processor_cache_hits > 0
            assert stats.encoder_cache_hits > 0
            # On the first pass the third prompt's prefix hit ends inside its image.
            third = passes[0][2]
            start, end = first_image_range(llm, third)
            assert start < third.num_cached_tokens < end
        assert_llm_idle(llm)
        llm.shutdown()


def test_prefix_cache_hit_ends_inside_an_image(vlm):
    family, path = vlm
    llm = LLM(path, block_size=4)
    first, third = cases(family)[0], cases(family)[2]
    run(llm, [first])
    (output,) = run(llm, [third])
    start, end = first_image_range(llm, output)
    # Cached: every full block up to the one holding the image's end and the new text.
    assert start < output.num_cached_tokens == 4 * (end // 4) < end
    reference = HFVisionReference(path)
    assert output.outputs[0].token_ids == reference.greedy(*third)[1][:MAX_NEW_TOKENS]
    assert_llm_idle(llm)
    llm.shutdown()


def test_different_images_share_only_the_text_before_them(vlm):
    family, path = vlm
    tag = PLACEHOLDER[family]
    text = f"Here is a question with a long preamble before the picture: {tag} What is it?"
    llm = LLM(path, block_size=4)
    (with_hopper,) = run(llm, [(text, [photo("grace_hopper")])])
    (with_coffee,) = run(llm, [(text, [photo("coffee.png")])])
    start, _ = first_image_range(llm, with_coffee)
    assert start >= 8  # the preamble fills whole blocks
    assert with_coffee.num_cached_tokens == 4 * (start // 4)
    assert_llm_idle(llm)
    llm.shutdown()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_same_image_in_three_requests_is_encoded_once(vlm):
    family, path = vlm
    tag = PLACEHOLDER[family]
    hopper = photo("grace_hopper")
    llm = LLM(path, block_size=4)
    before = llm.get_stats()
    prompts = [
        (f"{tag}Describe it.", [hopper]),
        (f"{tag}Describe it, briefly.", [hopper]),  # shares the image's KV blocks
        (f"Look at this: {tag}Describe it.", [hopper]),  # shares only the embeddings
    ]
    outputs = run(llm, prompts)
    stats = llm.get_stats()
    start, end = first_image_range(llm, outputs[0])
    assert stats.encoder_tokens_computed - before.encoder_tokens_computed == end - start
    assert stats.encoder_cache_hits - before.encoder_cache_hits == 1  # the third request
    shared = common_prefix(outputs[0].prompt_token_ids, outputs[1].prompt_token_ids)
    assert shared > end
    assert outputs[1].num_cached_tokens == 4 * (shared // 4)
    assert stats.prefix_cache_hits - before.prefix_cache_hits >= outputs[1].num_cached_tokens
    assert_llm_idle(llm)
    llm.shutdown()
