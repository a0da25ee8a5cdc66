"""Free queue, block pool and block hashing, checked with exact block ids and ref counts."""

from __future__ import annotations

import pytest

from mm_serve.cache.block_hash import (
    block_extra_keys,
    hash_block_tokens,
    update_block_hashes,
)
from mm_serve.cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from mm_serve.messages.request import MultiModalFeature, PlaceholderRange, Request
from mm_serve.messages.sampling_params import SamplingParams


def free_ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [block.block_id for block in queue.get_all_free_blocks()]


def make_queue(n: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


# ---------------------------------------------------------------- free queue


def test_free_queue_initial_order() -> None:
    _, queue = make_queue(5)
    assert free_ids(queue) == [0, 1, 2, 3, 4]
    assert queue.num_free_blocks == 5


def test_free_queue_popleft_remove_append_keep_order() -> None:
    blocks, queue = make_queue(6)
    assert queue.popleft().block_id == 0
    assert free_ids(queue) == [1, 2, 3, 4, 5]

    queue.remove(blocks[3])  # from the middle
    assert free_ids(queue) == [1, 2, 4, 5]
    assert blocks[3].prev_free is None and blocks[3].next_free is None

    queue.remove(blocks[5])  # the last one
    queue.remove(blocks[1])  # the first one
    assert free_ids(queue) == [2, 4]

    queue.append(blocks[3])
    queue.append_n([blocks[0], blocks[5]])
    assert free_ids(queue) == [2, 4, 3, 0, 5]
    assert queue.num_free_blocks == 5

    assert [b.block_id for b in queue.popleft_n(3)] == [2, 4, 3]
    assert free_ids(queue) == [0, 5]
    assert queue.num_free_blocks == 2


def test_free_queue_errors() -> None:
    blocks, queue = make_queue(2)
    with pytest.raises(ValueError):
        queue.popleft_n(3)
    assert queue.num_free_blocks == 2  # a failed popleft_n takes nothing
    queue.popleft_n(2)
    assert queue.num_free_blocks == 0
    assert free_ids(queue) == []
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.remove(blocks[0])  # not in the queue


# ---------------------------------------------------------------- block pool


def test_pool_get_new_and_free_blocks() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 2
    assert pool.usage == pytest.approx(0.6)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2

    pool.free_blocks([blocks[2], blocks[0], blocks[1]])
    assert free_ids(pool.free_block_queue) == [3, 4, 2, 0, 1]
    assert pool.num_free_blocks == 5
    assert pool.usage == 0.0
    with pytest.raises(ValueError, match="Double free"):
        pool.free_blocks([blocks[0]])


def test_pool_touch_removes_free_block_from_middle() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    block = pool.blocks[2]
    pool.touch([block])
    assert block.ref_cnt == 1
    assert free_ids(pool.free_block_queue) == [0, 1, 3]
    pool.touch([block])  # in use: only the ref count changes
    assert block.ref_cnt == 2
    assert pool.num_free_blocks == 3
    pool.free_blocks([block])
    assert free_ids(pool.free_block_queue) == [0, 1, 3]
    pool.free_blocks([block])
    assert free_ids(pool.free_block_queue) == [0, 1, 3, 2]


def test_pool_cache_full_blocks_and_lazy_eviction() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    h0 = hash_block_tokens(None, [1, 2])
    h1 = hash_block_tokens(h0, [3, 4])
    pool.cache_full_blocks(blocks, [h0, h1], num_cached_blocks=0, num_full_blocks=1)
    assert blocks[0].block_hash == h0 and blocks[1].block_hash is None
    pool.cache_full_blocks(blocks, [h0, h1], num_cached_blocks=1, num_full_blocks=2)
    assert pool.get_cached_block(h0) is blocks[0]
    assert pool.get_cached_block(h1) is blocks[1]

    pool.free_blocks(reversed(blocks))
    # Freed blocks stay cached until reused.
    assert free_ids(pool.free_block_queue) == [2, 1, 0]
    assert pool.get_cached_block(h1) is blocks[1]

    new = pool.get_new_blocks(2)  # pops 2 (never hashed), then 1: evicts h1
    assert [b.block_id for b in new] == [2, 1]
    assert pool.get_cached_block(h1) is None
    assert blocks[1].block_hash is None
    assert pool.get_cached_block(h0) is blocks[0]
    pool.free_blocks(new)


def test_pool_duplicate_hash_keeps_existing_mapping() -> None:
    pool = BlockPool(num_blocks=2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [7, 7])
    pool.cache_full_blocks([a], [h], 0, 1)
    pool.cache_full_blocks([b], [h], 0, 1)
    assert pool.get_cached_block(h) is a
    assert a.block_hash == h and b.block_hash is None
    pool.free_blocks([a, b])
    # Evicting the un-hashed duplicate leaves the mapping alone.
    assert pool.get_new_blocks(1) == [a]
    assert pool.get_cached_block(h) is None
    pool.free_blocks([a])


def test_pool_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(num_blocks=2, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_full_blocks(blocks, [h], 0, 1)
    assert blocks[0].block_hash is None and pool.get_cached_block(h) is None
    pool.free_blocks(blocks)


def test_pool_reset_prefix_cache() -> None:
    pool = BlockPool(num_blocks=2, enable_caching=True)
    blocks = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_full_blocks(blocks, [h], 0, 1)
    assert pool.reset_prefix_cache() is False  # a block is in use
    assert pool.get_cached_block(h) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h) is None
    assert blocks[0].block_hash is None
    assert pool.num_free_blocks == 2


# ---------------------------------------------------------------- block hashes


def make_request(
    tokens: list[int],
    mm: list[tuple[str, int, int]] | None = None,
    cache_salt: str | None = None,
) -> Request:
    features = [
        MultiModalFeature(mm_hash=h, placeholder=PlaceholderRange(off, n))
        for h, off, n in (mm or [])
    ]
    return Request("r", tokens, SamplingParams(), mm_features=features, cache_salt=cache_salt)


def test_hash_block_tokens_depends_on_every_input() -> None:
    h = hash_block_tokens(None, [1, 2, 3])
    assert len(h) == 16
    assert h == hash_block_tokens(None, [1, 2, 3])
    assert h == hash_block_tokens(None, [1, 2, 3], ())
    assert h != hash_block_tokens(None, [1, 2, 4])
    assert h != hash_block_tokens(h, [1, 2, 3])
    assert h != hash_block_tokens(None, [1, 2, 3], ("salt",))
    # Type tags and length framing: no collisions between look-alike keys.
    assert hash_block_tokens(None, [1], ("ab", "c")) != hash_block_tokens(None, [1], ("a", "bc"))
    assert hash_block_tokens(None, [1], ("1",)) != hash_block_tokens(None, [1], (1,))
    assert hash_block_tokens(None, [1], (("a", 0),)) != hash_block_tokens(None, [1], ("a", 0))
    with pytest.raises(TypeError):
        hash_block_tokens(None, [1], (1.5,))


def test_block_extra_keys_images_and_salt() -> None:
    # Image A on tokens [2, 6), image B on [6, 8).
    req = make_request(list(range(12)), mm=[("A", 2, 4), ("B", 6, 2)], cache_salt="s")
    assert block_extra_keys(req, 0, 4) == (("A", -2), "s")
    assert block_extra_keys(req, 4, 8) == (("A", 2), ("B", -2))
    assert block_extra_keys(req, 8, 12) == ()
    assert block_extra_keys(make_request([1, 2]), 0, 2) == ()


def test_update_block_hashes_is_incremental() -> None:
    req = make_request([1, 2, 3, 4, 5, 6, 7], cache_salt="s")
    update_block_hashes(req, block_size=3)
    h0 = hash_block_tokens(None, [1, 2, 3], ("s",))
    h1 = hash_block_tokens(h0, [4, 5, 6], ())
    assert req.block_hashes == [h0, h1]  # the partial block [7] is not hashed
    update_block_hashes(req, block_size=3)
    assert req.block_hashes == [h0, h1]
    req.append_output_token(8)
    update_block_hashes(req, block_size=3)
    assert len(req.block_hashes) == 2
    req.append_output_token(9)
    update_block_hashes(req, block_size=3)
    assert req.block_hashes == [h0, h1, hash_block_tokens(h1, [7, 8, 9], ())]
