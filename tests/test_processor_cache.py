"""The processor cache: LRU order, byte bound, counters; and through LLM: repeated images skip
the preprocessing pool, uuids key the cache, cache_salt reaches the requests."""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mm_serve import LLM, SamplingParams
from mm_serve.cache import ProcessorCache
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

TAG = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def test_lru_order_and_byte_bound():
    cache = ProcessorCache(capacity_bytes=300)
    for name in "abc":
        cache.put(name, name.upper(), nbytes=100)
    assert cache.get("a") == "A"  # a is now the most recently used
    cache.put("d", "D", nbytes=100)  # evicts b, the least recently used
    assert "b" not in cache and {"a", "c", "d"} == {k for k in "abcd" if k in cache}
    cache.put("e", "E", nbytes=250)  # evicts c, a and d, oldest first
    assert len(cache) == 1 and cache.num_bytes == 250
    cache.put("f", "F", nbytes=301)  # larger than the whole cache: not stored
    assert "f" not in cache and cache.get("e") == "E"
    cache.put("e", "E2", nbytes=50)  # stored again: replaced, bytes recounted
    assert cache.get("e") == "E2" and cache.num_bytes == 50


def test_counters():
    cache = ProcessorCache(capacity_bytes=1 << 20)
    assert cache.get("x") is None
    cache.put("x", object(), nbytes=10)
    assert cache.get("x") is not None and cache.get("x") is not None and cache.get("y") is None
    assert (cache.queries, cache.hits) == (4, 2)


def test_capacity_zero_stores_nothing():
    cache = ProcessorCache(capacity_bytes=0)
    cache.put("x", "X", nbytes=0)
    cache.put("y", "Y", nbytes=1)
    assert len(cache) == 0 and cache.get("x") is None and cache.get("y") is None
    assert (cache.queries, cache.hits) == (2, 0)
    with pytest.raises(ValueError, match="negative"):
        ProcessorCache(capacity_bytes=-1)


def photo(name: str) -> Image.Image:
    import skimage

    return Image.open(Path(skimage.__file__).parent / "data" / name)


def jpeg(image: Image.Image, quality: int = 90) -> bytes:
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def qwen2_vl_path(tmp_path_factory) -> str:
    return build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", seed=3)


@pytest.fixture(scope="module")
def llm(qwen2_vl_path):
    llm = LLM(qwen2_vl_path, multiprocess=False)
    yield llm
    llm.shutdown()


def image_prompt(image, **extra) -> dict:
    return {"prompt": f"{TAG}Describe it.", "multi_modal_data": {"image": [image]}, **extra}


def assert_no_kv_leak(llm: LLM) -> None:
    kv = llm.engine_core.scheduler.kv_cache_manager
    assert not llm.engine_core.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks


def test_repeated_image_is_a_hit_with_the_same_tokens(llm):
    image = jpeg(photo("coffee.png"))
    before = llm.get_stats()
    first = llm.generate(image_prompt(image), GREEDY, use_tqdm=False)
    middle = llm.get_stats()
    assert middle.processor_cache_queries == before.processor_cache_queries + 1
    assert middle.processor_cache_hits == before.processor_cache_hits
    second = llm.generate(image_prompt(image), GREEDY, use_tqdm=False)
    after = llm.get_stats()
    assert after.processor_cache_hits == middle.processor_cache_hits + 1
    assert second[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert second[0].prompt_token_ids == first[0].prompt_token_ids
    assert_no_kv_leak(llm)


def test_same_image_in_one_batch_goes_to_the_pool_once(llm, monkeypatch):
    pool = llm.input_processor.mm_processor.pool
    submitted = []
    real_submit = pool.submit
    monkeypatch.setattr(
        pool,
        "submit",
        lambda source, processor=None, group=None: (
            submitted.append(source) or real_submit(source, processor, group)
        ),
    )
    image = jpeg(photo("rocket.jpg"))
    outputs = llm.generate([image_prompt(image)] * 3, GREEDY, use_tqdm=False)
    assert submitted == [image]
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    assert_no_kv_leak(llm)


def test_decoded_image_at_its_size_skips_the_pool(llm, monkeypatch):
    """A PIL image whose preprocessing only copies its pixels (RGB, at the size the processor
    gives it) is preprocessed in the calling thread, with the pool's result and tokens; a
    resized one, a grey one and encoded bytes still go to the pool."""
    mm_processor = llm.input_processor.mm_processor
    submitted = []
    real_submit = mm_processor.pool.submit
    monkeypatch.setattr(
        mm_processor.pool,
        "submit",
        lambda source, processor=None, group=None: (
            submitted.append(source) or real_submit(source, processor, group)
        ),
    )
    factor = mm_processor.processor.factor
    at_size = photo("astronaut.png").convert("RGB").resize((8 * factor, 6 * factor))
    assert mm_processor.processor.copies_only(at_size)
    pooled = [at_size.resize((8 * factor + 5, 6 * factor)), at_size.convert("L"), jpeg(at_size)]
    assert not any(mm_processor.processor.copies_only(image) for image in pooled[:2])
    here = llm.generate(image_prompt(at_size), GREEDY, use_tqdm=False)
    assert submitted == []
    inline = mm_processor._start_image(at_size, None, None).result()
    pool = real_submit(at_size).result()
    assert inline.pid == os.getpid() != pool.pid
    assert np.array_equal(inline.pixel_values, pool.pixel_values)
    assert (inline.num_tokens, inline.image_grid_thw) == (pool.num_tokens, pool.image_grid_thw)
    assert (inline.pixel_mean, inline.pixel_std) == (pool.pixel_mean, pool.pixel_std)
    llm.generate([image_prompt(image) for image in pooled], GREEDY, use_tqdm=False)
    assert len(submitted) == 3
    again = llm.generate(image_prompt(at_size.copy()), GREEDY, use_tqdm=False)  # a cache hit
    assert again[0].outputs[0].token_ids == here[0].outputs[0].token_ids
    assert_no_kv_leak(llm)


def test_cache_off_has_no_hits(qwen2_vl_path):
    llm = LLM(qwen2_vl_path, mm_processor_cache_gb=0, multiprocess=False)
    image = jpeg(photo("coffee.png"))
    first = llm.generate(image_prompt(image), GREEDY, use_tqdm=False)
    second = llm.generate(image_prompt(image), GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.processor_cache_queries == 2 and stats.processor_cache_hits == 0
    assert second[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    llm.shutdown()


def test_uuid_through_chat(llm):
    def conversation(image: bytes, uuid: str) -> list[dict]:
        url = "data:image/jpeg;base64," + base64.b64encode(image).decode()
        image_part = {"type": "image_url", "image_url": {"url": url}, "uuid": uuid}
        return [{"role": "user", "content": [image_part, {"type": "text", "text": "What?"}]}]

    astronaut, chelsea = jpeg(photo("astronaut.png")), jpeg(photo("chelsea.png"))
    prompt = llm.input_processor.apply_chat_template(conversation(astronaut, "img-1"))
    assert prompt["multi_modal_uuids"] == {"image": ["img-1"]}
    (first,) = llm.chat(conversation(astronaut, "img-1"), GREEDY, use_tqdm=False)
    hits = llm.get_stats().processor_cache_hits
    # Other bytes under the same uuid: the uuid names the content, so the cached image is used.
    (second,) = llm.chat(conversation(chelsea, "img-1"), GREEDY, use_tqdm=False)
    assert llm.get_stats().processor_cache_hits == hits + 1
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    pending = llm.input_processor.process(prompt)
    other = llm.input_processor.process({**prompt, "multi_modal_uuids": {"image": ["img-2"]}})
    assert pending.result().mm_features[0].mm_hash != other.result().mm_features[0].mm_hash
    assert_no_kv_leak(llm)


def test_uuids_and_cache_salt_are_validated_and_passed_on(llm):
    image = jpeg(photo("coffee.png"))
    with pytest.raises(ValueError, match="uuids"):
        llm.generate(image_prompt(image, multi_modal_uuids={"image": ["a", "b"]}), GREEDY)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate(image_prompt(image, cache_salt=3), GREEDY)
    with pytest.raises(ValueError, match="Unknown prompt keys"):
        llm.generate(image_prompt(image, multi_modal_uuid="a"), GREEDY)
    processed = llm.input_processor.process(image_prompt(image, cache_salt="tenant-a")).result()
    params = SamplingParams(n=2, max_tokens=2)
    requests = llm.input_processor.make_requests("r", processed, params)
    assert [r.cache_salt for r in requests] == ["tenant-a", "tenant-a"]
    (output,) = llm.generate(image_prompt(image, cache_salt="tenant-a"), GREEDY, use_tqdm=False)
    assert output.outputs[0].token_ids
    assert_no_kv_leak(llm)
