"""KVCacheManager with prefix caching for one full-attention KV-cache group, on hand-built
requests (block_size 4, 10 blocks).

In the style of vLLM's tests/v1/core/test_prefix_caching.py: exact block ids, ref counts,
free-queue order and hit counts. Every test must leave all blocks free (checked on teardown).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mm_serve.cache import KVCacheBlock, KVCacheManager
from mm_serve.cache.kv_cache_groups import KVCacheGroup, KVCacheLayout
from mm_serve.messages.request import MultiModalFeature, PlaceholderRange, Request
from mm_serve.messages.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 10


@pytest.fixture
def manager() -> Iterator[KVCacheManager]:
    mgr = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
    yield mgr
    assert mgr.num_free_blocks == NUM_BLOCKS, "a test leaked blocks"
    assert all(block.ref_cnt == 0 for block in mgr.block_pool.blocks)
    assert mgr.req_to_blocks == {}


def make_request(
    request_id: str,
    tokens: list[int],
    mm: list[tuple[str, int, int]] | None = None,
    cache_salt: str | None = None,
    prompt_logprobs: int | None = None,
) -> Request:
    features = [
        MultiModalFeature(mm_hash=h, placeholder=PlaceholderRange(off, n))
        for h, off, n in (mm or [])
    ]
    params = SamplingParams(prompt_logprobs=prompt_logprobs)
    return Request(request_id, tokens, params, mm_features=features, cache_salt=cache_salt)


def lookup(manager: KVCacheManager, req: Request) -> tuple[list[KVCacheBlock], int]:
    """``get_computed_blocks`` of the one KV-cache group: its hit blocks and tokens."""
    (hit_blocks,), num_hit_tokens = manager.get_computed_blocks(req)
    return hit_blocks, num_hit_tokens


def schedule_prefill(manager: KVCacheManager, req: Request) -> list[KVCacheBlock]:
    """What the scheduler does for a waiting request: look up, allocate, run the whole prompt."""
    hit_blocks, num_hit_tokens = lookup(manager, req)
    num_new = req.num_tokens - num_hit_tokens
    new_blocks = manager.allocate_slots(req, num_new, num_hit_tokens, [hit_blocks])
    assert new_blocks is not None
    req.num_computed_tokens = req.num_tokens
    return new_blocks


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def free_ids(manager: KVCacheManager) -> list[int]:
    return ids(manager.block_pool.free_block_queue.get_all_free_blocks())


def test_prefill_allocates_exact_blocks(manager: KVCacheManager) -> None:
    req = make_request("0", list(range(10)))  # 2 full blocks + 2 tokens
    assert lookup(manager, req) == ([], 0)
    new_blocks = manager.allocate_slots(req, 10)
    assert new_blocks is not None and ids(new_blocks) == [0, 1, 2]
    assert manager.get_block_ids("0") == [0, 1, 2]
    assert [b.ref_cnt for b in new_blocks] == [1, 1, 1]
    assert len(req.block_hashes) == 2
    assert [b.block_hash for b in new_blocks] == [*req.block_hashes, None]
    assert manager.num_free_blocks == 7
    assert manager.usage == pytest.approx(0.3)

    manager.free(req)
    # Freed tail first, after the never-used blocks.
    assert free_ids(manager) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    with pytest.raises(KeyError, match="holds no KV-cache blocks"):
        manager.get_block_ids("0")


def test_two_live_requests_share_common_prefix(manager: KVCacheManager) -> None:
    req0 = make_request("0", list(range(10)))
    assert ids(schedule_prefill(manager, req0)) == [0, 1, 2]

    req1 = make_request("1", list(range(8)) + [100, 101, 102])
    hit_blocks, num_hit_tokens = lookup(manager, req1)
    assert ids(hit_blocks) == [0, 1] and num_hit_tokens == 8
    assert [b.ref_cnt for b in hit_blocks] == [1, 1]  # not touched by the lookup
    new_blocks = manager.allocate_slots(req1, 3, num_hit_tokens, [hit_blocks])
    assert new_blocks is not None and ids(new_blocks) == [3]
    assert manager.get_block_ids("1") == [0, 1, 3]
    assert [b.ref_cnt for b in manager.block_pool.blocks[:4]] == [2, 2, 1, 1]
    assert manager.num_free_blocks == 6

    manager.free(req0)
    assert [b.ref_cnt for b in manager.block_pool.blocks[:4]] == [1, 1, 0, 1]
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 2]
    manager.free(req1)
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]


def test_hit_on_freed_cached_blocks_removes_them_from_middle(manager: KVCacheManager) -> None:
    req0 = make_request("0", list(range(12)))
    schedule_prefill(manager, req0)  # blocks 0, 1, 2, all full and cached
    manager.free(req0)
    assert free_ids(manager) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]

    req1 = make_request("1", list(range(8)) + [50, 51])
    hit_blocks, num_hit_tokens = lookup(manager, req1)
    assert ids(hit_blocks) == [0, 1] and num_hit_tokens == 8
    new_blocks = manager.allocate_slots(req1, 2, num_hit_tokens, [hit_blocks])
    assert new_blocks is not None and ids(new_blocks) == [3]
    assert manager.get_block_ids("1") == [0, 1, 3]
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 2]
    assert [b.ref_cnt for b in manager.block_pool.blocks[:4]] == [1, 1, 0, 1]
    manager.free(req1)


def test_eviction_is_lru_and_tail_first(manager: KVCacheManager) -> None:
    req_a = make_request("a", list(range(12)))
    req_b = make_request("b", list(range(100, 112)))
    assert ids(schedule_prefill(manager, req_a)) == [0, 1, 2]
    assert ids(schedule_prefill(manager, req_b)) == [3, 4, 5]
    manager.free(req_a)
    manager.free(req_b)
    assert free_ids(manager) == [6, 7, 8, 9, 2, 1, 0, 5, 4, 3]

    # 6 blocks: the 4 never-used ones, then a's tail block 2, then a's block 1.
    req_c = make_request("c", list(range(200, 224)))
    assert ids(schedule_prefill(manager, req_c)) == [6, 7, 8, 9, 2, 1]
    pool = manager.block_pool
    assert pool.get_cached_block(req_a.block_hashes[0]) is pool.blocks[0]
    assert pool.get_cached_block(req_a.block_hashes[1]) is None
    assert pool.get_cached_block(req_a.block_hashes[2]) is None
    assert [pool.get_cached_block(h) for h in req_b.block_hashes] == [
        pool.blocks[i] for i in (3, 4, 5)
    ]

    # a's first block still hits; the chain stops at the evicted second block.
    req_d = make_request("d", list(range(12)) + [0])
    hit_blocks, num_hit_tokens = lookup(manager, req_d)
    assert ids(hit_blocks) == [0] and num_hit_tokens == 4
    manager.free(req_c)


def test_hit_is_capped_when_whole_prompt_is_cached(manager: KVCacheManager) -> None:
    req0 = make_request("0", list(range(8)))
    schedule_prefill(manager, req0)
    manager.free(req0)
    assert free_ids(manager) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]

    req1 = make_request("1", list(range(8)))
    hit_blocks, num_hit_tokens = lookup(manager, req1)
    # At most (8 - 1) // 4 = 1 block: the last token must be computed for its logits.
    assert ids(hit_blocks) == [0] and num_hit_tokens == 4
    new_blocks = manager.allocate_slots(req1, 4, num_hit_tokens, [hit_blocks])
    assert new_blocks is not None and ids(new_blocks) == [2]
    # Block 2 holds the same content as cached block 1: the existing mapping is kept.
    pool = manager.block_pool
    assert pool.get_cached_block(req1.block_hashes[1]) is pool.blocks[1]
    assert pool.blocks[2].block_hash is None
    manager.free(req1)
    assert free_ids(manager) == [3, 4, 5, 6, 7, 8, 9, 1, 2, 0]


def test_duplicate_hash_from_same_step(manager: KVCacheManager) -> None:
    req_a = make_request("a", list(range(9)))
    req_b = make_request("b", list(range(9)))
    # Both looked up before either is allocated: both miss.
    assert lookup(manager, req_a) == ([], 0)
    assert lookup(manager, req_b) == ([], 0)
    assert ids(manager.allocate_slots(req_a, 9) or []) == [0, 1, 2]
    assert ids(manager.allocate_slots(req_b, 9) or []) == [3, 4, 5]
    pool = manager.block_pool
    assert [pool.get_cached_block(h) for h in req_a.block_hashes] == pool.blocks[:2]
    assert [pool.blocks[i].block_hash for i in (3, 4, 5)] == [None, None, None]
    manager.free(req_b)
    manager.free(req_a)

    req_c = make_request("c", list(range(9)))
    hit_blocks, _ = lookup(manager, req_c)
    assert ids(hit_blocks) == [0, 1]


def test_hit_within_the_same_step(manager: KVCacheManager) -> None:
    # a's hashes are registered at allocation: b, scheduled later in the same step, hits them.
    req_a = make_request("a", list(range(9)))
    schedule_prefill(manager, req_a)
    req_b = make_request("b", list(range(9)))
    hit_blocks, num_hit_tokens = lookup(manager, req_b)
    assert ids(hit_blocks) == [0, 1] and num_hit_tokens == 8
    assert ids(manager.allocate_slots(req_b, 1, 8, [hit_blocks]) or []) == [3]
    manager.free(req_a)
    manager.free(req_b)


def test_no_lookup_when_caching_off() -> None:
    manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=False)
    req0 = make_request("0", list(range(9)))
    schedule_prefill(manager, req0)
    assert req0.block_hashes == []
    assert all(b.block_hash is None for b in manager.block_pool.blocks)
    manager.free(req0)
    req1 = make_request("1", list(range(9)))
    assert lookup(manager, req1) == ([], 0)
    assert manager.make_prefix_cache_stats().requests == 0
    assert manager.num_free_blocks == NUM_BLOCKS


def test_no_hit_with_prompt_logprobs(manager: KVCacheManager) -> None:
    req0 = make_request("0", list(range(9)))
    schedule_prefill(manager, req0)
    manager.free(req0)
    req1 = make_request("1", list(range(9)), prompt_logprobs=1)
    assert lookup(manager, req1) == ([], 0)
    # Its own full blocks are still cached for others.
    assert ids(schedule_prefill(manager, req1)) == [3, 4, 5]
    req2 = make_request("2", list(range(9)))
    hit_blocks, _ = lookup(manager, req2)
    assert ids(hit_blocks) == [0, 1]  # the existing mapping wins over req1's duplicates
    manager.free(req1)


def test_cache_salt_isolation(manager: KVCacheManager) -> None:
    tokens = list(range(13))
    req0 = make_request("0", tokens, cache_salt="alice")
    schedule_prefill(manager, req0)
    manager.free(req0)
    assert lookup(manager, make_request("1", tokens, cache_salt="bob")) == ([], 0)
    assert lookup(manager, make_request("2", tokens)) == ([], 0)
    hit_blocks, num_hit_tokens = lookup(manager, make_request("3", tokens, cache_salt="alice"))
    assert ids(hit_blocks) == [0, 1, 2] and num_hit_tokens == 12


def test_mm_hash_isolation(manager: KVCacheManager) -> None:
    # 4 text tokens, an image on tokens [4, 12) (placeholder id 9), 5 text tokens.
    tokens = [1, 2, 3, 4] + [9] * 8 + [5, 6, 7, 8, 0]
    req0 = make_request("0", tokens, mm=[("cat", 4, 8)])
    schedule_prefill(manager, req0)
    manager.free(req0)

    other_image = make_request("1", tokens, mm=[("dog", 4, 8)])
    hit_blocks, num_hit_tokens = lookup(manager, other_image)
    assert ids(hit_blocks) == [0] and num_hit_tokens == 4  # only the text before the image

    same_image = make_request("2", tokens, mm=[("cat", 4, 8)])
    hit_blocks, num_hit_tokens = lookup(manager, same_image)
    assert ids(hit_blocks) == [0, 1, 2, 3] and num_hit_tokens == 16

    shifted = make_request("3", tokens, mm=[("cat", 5, 7)])  # same image, other range
    hit_blocks, _ = lookup(manager, shifted)
    assert ids(hit_blocks) == [0]


def test_decode_caches_output_blocks(manager: KVCacheManager) -> None:
    req = make_request("0", list(range(6)))
    assert ids(schedule_prefill(manager, req)) == [0, 1]
    pool = manager.block_pool
    assert pool.blocks[1].block_hash is None

    req.append_output_token(60)  # 7 tokens: block 1 not full yet
    assert manager.allocate_slots(req, 1) == []
    req.num_computed_tokens += 1
    assert pool.blocks[1].block_hash is None

    req.append_output_token(70)  # 8 tokens: block 1 full in this step
    assert manager.allocate_slots(req, 1) == []
    req.num_computed_tokens += 1
    assert len(req.block_hashes) == 2
    assert pool.blocks[1].block_hash == req.block_hashes[1]

    req.append_output_token(80)  # 9 tokens: a new block
    assert ids(manager.allocate_slots(req, 1) or []) == [2]
    req.num_computed_tokens += 1
    assert manager.get_block_ids("0") == [0, 1, 2]

    follow_up = make_request("1", [0, 1, 2, 3, 4, 5, 60, 70, 99])
    hit_blocks, num_hit_tokens = lookup(manager, follow_up)
    assert ids(hit_blocks) == [0, 1] and num_hit_tokens == 8
    manager.free(req)


def test_chunked_prefill_caches_each_full_chunk(manager: KVCacheManager) -> None:
    req = make_request("0", list(range(10)))
    assert ids(manager.allocate_slots(req, 5) or []) == [0, 1]
    req.num_computed_tokens = 5
    pool = manager.block_pool
    assert [pool.blocks[i].block_hash is not None for i in (0, 1)] == [True, False]
    assert ids(manager.allocate_slots(req, 5) or []) == [2]
    req.num_computed_tokens = 10
    assert [pool.blocks[i].block_hash is not None for i in (0, 1, 2)] == [True, True, False]
    manager.free(req)


def test_out_of_blocks_returns_none_and_changes_nothing() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    req0 = make_request("0", list(range(8)) + [40])
    schedule_prefill(manager, req0)  # blocks 0, 1, 2
    manager.free(req0)
    pool = manager.block_pool
    order = [3, 2, 1, 0]
    assert free_ids(manager) == order

    # Hits blocks 0 and 1 (free, cached) and needs 3 new blocks: only 2 are left besides them.
    req1 = make_request("1", list(range(8)) + list(range(100, 109)))
    hit_blocks, num_hit_tokens = lookup(manager, req1)
    assert ids(hit_blocks) == [0, 1]
    assert manager.allocate_slots(req1, 9, num_hit_tokens, [hit_blocks]) is None
    assert free_ids(manager) == order
    assert [b.ref_cnt for b in pool.blocks] == [0, 0, 0, 0]
    assert pool.get_cached_block(req0.block_hashes[0]) is pool.blocks[0]
    assert "1" not in manager.req_to_blocks

    # A running request that cannot grow keeps its blocks.
    req2 = make_request("2", list(range(200, 212)))
    assert ids(manager.allocate_slots(req2, 12) or []) == [3, 2, 1]
    req2.num_computed_tokens = 12
    assert manager.allocate_slots(req2, 8) is None
    assert manager.get_block_ids("2") == [3, 2, 1]
    assert free_ids(manager) == [0]
    manager.free(req2)
    assert manager.num_free_blocks == 4


def test_preempted_request_hits_its_own_blocks(manager: KVCacheManager) -> None:
    req = make_request("0", list(range(10)))
    schedule_prefill(manager, req)
    for token_id in (11, 12):
        req.append_output_token(token_id)
    manager.free(req)  # preempted
    req.num_computed_tokens = 0
    hit_blocks, num_hit_tokens = lookup(manager, req)
    assert ids(hit_blocks) == [0, 1] and num_hit_tokens == 8
    # Block 2 held a partial block (never hashed): it is not reused, a fresh block comes from
    # the queue head.
    assert ids(manager.allocate_slots(req, 4, 8, [hit_blocks]) or []) == [3]
    assert manager.get_block_ids("0") == [0, 1, 3]
    manager.free(req)


def test_prefix_cache_stats(manager: KVCacheManager) -> None:
    req0 = make_request("0", list(range(10)))
    schedule_prefill(manager, req0)  # miss: 10 queried, 0 hit
    req1 = make_request("1", list(range(10)))
    schedule_prefill(manager, req1)  # 8 of 10 hit
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 20, 8)
    assert stats.hit_rate == pytest.approx(0.4)
    fresh = manager.make_prefix_cache_stats()
    assert (fresh.requests, fresh.queries, fresh.hits, fresh.hit_rate) == (0, 0, 0, 0.0)
    manager.free(req0)
    manager.free(req1)


def test_reset_prefix_cache_and_errors(manager: KVCacheManager) -> None:
    req = make_request("0", list(range(9)))
    schedule_prefill(manager, req)
    assert manager.reset_prefix_cache() is False
    manager.free(req)
    manager.free(req)  # freeing a request without blocks is a no-op
    assert manager.reset_prefix_cache() is True
    assert lookup(manager, make_request("1", list(range(9)))) == ([], 0)
    with pytest.raises(ValueError, match="does not match"):
        manager.allocate_slots(make_request("2", [1, 2]), 1, num_new_computed_tokens=4)
    with pytest.raises(ValueError, match="non-negative"):
        manager.allocate_slots(make_request("3", [1, 2]), -1)


@pytest.mark.parametrize("caching", [True, False])
def test_slot_limit_is_where_allocate_slots_has_work(caching: bool) -> None:
    """Below ``slot_limit`` a one-token decode step allocates and registers nothing; at it,
    the step allocates a block or registers a full one (the scheduler's fast path)."""
    manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=caching)
    req = make_request("0", list(range(6)))
    assert manager.slot_limit("0") == 0  # no blocks yet
    schedule_prefill(manager, req)
    fast_steps = 0
    for token in range(100, 125):
        req.append_output_token(token)
        limit = manager.slot_limit("0")
        assert manager.slot_limits["0"] == limit
        before = (manager.get_block_ids("0"), manager.num_cached_blocks["0"])
        blocks = manager.allocate_slots(req, 1)
        after = (manager.get_block_ids("0"), manager.num_cached_blocks["0"])
        if req.num_computed_tokens < limit:
            fast_steps += 1
            assert blocks == [] and after == before
        else:
            assert blocks or after != before
        req.num_computed_tokens += 1
    # Work: a new block at 9, 13, ..., 29 tokens; with caching, registering at 8, 12, ..., 28.
    assert fast_steps == (13 if caching else 19)
    manager.free(req)
    assert "0" not in manager.slot_limits
    assert manager.num_free_blocks == NUM_BLOCKS


def test_no_slot_limit_where_blocks_are_skipped() -> None:
    """A sliding-window group frees blocks as the window moves: no fast path."""
    layout = KVCacheLayout((KVCacheGroup((0,)), KVCacheGroup((1,), sliding_window=4)))
    manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, layout)
    req = make_request("0", list(range(6)))
    assert manager.allocate_slots(req, 6)
    assert manager.slot_limit("0") == 0 and "0" not in manager.slot_limits
    manager.free(req)
