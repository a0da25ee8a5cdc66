"""KV-cache groups and the KV-cache manager over several groups, on hand-built requests.

Layout rule (vLLM's) on real configs' layer patterns; then a full-attention group and a
sliding-window group (window 6, block size 4: a query needs the last 2 blocks) over one pool
of 20 blocks plus the null block: exact block ids, out-of-window blocks freed as prefill
chunks advance, prefix hits needing only the last window's blocks in the sliding group.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mm_serve.cache.block_pool import BlockPool
from mm_serve.cache.kv_cache_groups import KVCacheGroup, KVCacheLayout, kv_cache_layout
from mm_serve.cache.kv_cache_manager import KVCacheManager, group_key
from mm_serve.cache.kv_cache_policies import FullAttentionPolicy, SlidingWindowPolicy
from mm_serve.messages.request import Request
from mm_serve.messages.sampling_params import SamplingParams

BLOCK_SIZE, WINDOW, NUM_BLOCKS = 4, 6, 21
LAYOUT = KVCacheLayout((KVCacheGroup((1,)), KVCacheGroup((0,), WINDOW)))


def gemma3_config(types: list[str], window: int | None = 1024) -> dict:
    text = {"num_hidden_layers": len(types), "layer_types": types, "sliding_window": window}
    return {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": text}


def test_layout_groups_layers_as_vllm() -> None:
    # Gemma 3 4B: 34 layers, every 6th full -> 5 full, 29 sliding: groups of 5.
    types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(34)]
    layout = kv_cache_layout(gemma3_config(types))
    assert layout.num_groups == 7 and layout.layers_per_group == 5
    assert layout.groups[0] == KVCacheGroup((5, 11, 17, 23, 29), None)
    assert layout.groups[1] == KVCacheGroup((0, 1, 2, 3, 4), 1024)
    assert layout.groups[-1] == KVCacheGroup((30, 31, 32, 33), 1024)  # padded
    assert layout.layer_slots()[5] == (0, 0) and layout.layer_slots()[33] == (6, 3)
    # Nearly as many of each: one group per type, of the larger size.
    layout = kv_cache_layout(gemma3_config(["full_attention"] * 8 + ["sliding_attention"] * 9))
    assert [len(g.layers) for g in layout.groups] == [8, 9] and layout.layers_per_group == 9
    # One type, no window, or a family without sliding windows: one group of every layer.
    assert kv_cache_layout(gemma3_config(["full_attention"] * 3)).num_groups == 1
    assert kv_cache_layout(gemma3_config(["sliding_attention"] * 2, None)).num_groups == 1
    llama = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 3, "sliding_window": 9}
    assert kv_cache_layout(llama) == KVCacheLayout((KVCacheGroup((0, 1, 2)),))
    assert KVCacheManager(8, 4, kv_cache_layout(llama)).policies == [FullAttentionPolicy()]


@pytest.fixture
def manager() -> Iterator[KVCacheManager]:
    mgr = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, LAYOUT)
    assert mgr.num_blocks == NUM_BLOCKS - 1 == mgr.num_free_blocks  # block 0: the null block
    yield mgr
    assert mgr.num_free_blocks == mgr.num_blocks, "a test leaked blocks"
    assert all(block.ref_cnt == 0 for block in mgr.block_pool.blocks)
    assert mgr.null_block.block_hash is None and mgr.req_to_blocks == {}


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams())


def run_chunk(manager: KVCacheManager, req: Request, num_new: int) -> list[int] | None:
    """One scheduled chunk: allocate, then count the tokens as computed."""
    blocks = manager.allocate_slots(req, num_new)
    if blocks is not None:
        req.num_computed_tokens += num_new
    return None if blocks is None else [b.block_id for b in blocks]


def group_ids(manager: KVCacheManager, request_id: str) -> list[list[int]]:
    return [[b.block_id for b in blocks] for blocks in manager.req_to_blocks[request_id]]


def test_chunks_free_blocks_out_of_the_window(manager) -> None:
    req = make_request("a", list(range(30)))
    # Interleaved ids: for each block position, the full group's then the sliding group's.
    assert run_chunk(manager, req, 8) == [1, 3, 2, 4]
    assert run_chunk(manager, req, 8) == [5, 7, 6, 8]  # window of 16 starts at 11: all kept
    assert manager.num_free_blocks == 12
    # Next chunk from 16: its window starts at 11 (block 2), so blocks 0-1 (ids 3, 4) go.
    assert run_chunk(manager, req, 8) == [9, 11, 10, 12]
    assert group_ids(manager, "a") == [[1, 2, 5, 6, 9, 10], [0, 0, 7, 8, 11, 12]]
    assert manager.num_free_blocks == 20 - 12 + 2
    assert manager.get_block_ids("a") == [1, 0, 2, 0, 5, 7, 6, 8, 9, 11, 10, 12]
    # Decoding past 30 tokens: the sliding group keeps 2-3 blocks, the full group grows.
    assert run_chunk(manager, req, 6) == [13, 15, 14, 16]
    for _ in range(10):
        run_chunk(manager, req, 1)
    sliding = [b for b in manager.req_to_blocks["a"][1] if b is not manager.null_block]
    assert len(sliding) <= 3 and len(manager.req_to_blocks["a"][0]) == 10
    manager.free(req)


def test_allocation_fails_without_room(manager) -> None:
    req = make_request("r", list(range(100)))
    assert run_chunk(manager, req, 44) is None  # 2 groups x 11 blocks > 20 free
    assert manager.num_free_blocks == 20 and "r" not in manager.req_to_blocks
    assert run_chunk(manager, req, 40) is not None and manager.num_free_blocks == 0
    manager.free(req)


def prefill(manager: KVCacheManager, req: Request, chunk: int = 8) -> None:
    hits, num_hit = manager.get_computed_blocks(req)
    assert manager.allocate_slots(req, 0, num_hit, hits) is not None
    req.num_computed_tokens = num_hit
    while req.num_computed_tokens < req.num_tokens:
        run_chunk(manager, req, min(chunk, req.num_tokens - req.num_computed_tokens))


def test_prefix_hit_needs_only_the_last_window(manager) -> None:
    first = make_request("first", list(range(29)))
    prefill(manager, first)
    first_full = group_ids(manager, "first")[0]
    manager.free(first)
    second = make_request("second", list(range(29)) + [99])
    hits, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 28  # 7 full blocks: (30 - 1) // 4
    full, sliding = hits
    assert [b.block_id for b in full] == first_full[:7]  # its 8th block is partial
    # The first token to compute (28) sees keys 23..28: blocks 5 and 6 only.
    assert sliding[:5] == [manager.null_block] * 5
    assert manager.null_block not in sliding[5:] and len(sliding) == 7
    assert manager.allocate_slots(second, 2, num_hit, hits) is not None
    interleaved = manager.get_block_ids("second")
    assert interleaved[0:10:2] == first_full[:5] and interleaved[1:10:2] == [0] * 5
    manager.free(second)


def test_prefix_hit_shortened_to_a_cached_window(manager) -> None:
    first = make_request("first", list(range(24)))
    prefill(manager, first, chunk=24)  # one chunk: nothing freed, every block cached
    manager.free(first)
    # Evict the sliding group's block 4 only: no cached window ends at block 5 any more.
    pool = manager.block_pool
    evicted = pool.get_cached_block(group_key(first.block_hashes[4], 1))
    pool.free_block_queue.remove(evicted)
    pool._evict(evicted)
    pool.free_block_queue.append(evicted)
    second = make_request("second", list(range(24)) + [7, 7])
    hits, num_hit = manager.get_computed_blocks(second)
    # Full group: 6 blocks; sliding: blocks 2-3 are the last window before 16 -> 4 blocks.
    assert num_hit == 16
    assert [len(blocks) for blocks in hits] == [4, 4]
    assert hits[1][:2] == [manager.null_block] * 2 and manager.null_block not in hits[1][2:]
    assert manager.allocate_slots(second, 10, num_hit, hits) is not None
    manager.free(second)


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def ref_counts(manager: KVCacheManager, block_ids: range) -> list[int]:
    return [manager.block_pool.blocks[i].ref_cnt for i in block_ids]


def pool_refs_ok(manager: KVCacheManager) -> bool:
    """Every block's ref count is the number of tables that hold it."""
    held: dict[int, int] = {}
    for groups in manager.req_to_blocks.values():
        for blocks in groups:
            for blk in blocks:
                if blk is not manager.null_block:
                    held[blk.block_id] = held.get(blk.block_id, 0) + 1
    return all(blk.ref_cnt == held.get(blk.block_id, 0) for blk in manager.block_pool.blocks)


def test_policies_and_the_null_block() -> None:
    sliding = SlidingWindowPolicy(WINDOW, BLOCK_SIZE)  # a query at q reads keys q-5..q
    assert [sliding.num_skipped_blocks(n) for n in (0, 5, 8, 9, 12, 13)] == [0, 0, 0, 1, 1, 2]
    assert FullAttentionPolicy().num_skipped_blocks(100) == 0
    pool = BlockPool(4, reserve_null_block=True)
    assert SlidingWindowPolicy(1, BLOCK_SIZE).find_cache_hit(pool, [], 3) == [pool.null_block] * 3
    # The null block only for a layout with a group that skips blocks: one sliding group too.
    plain = KVCacheManager(10, BLOCK_SIZE)
    assert plain.null_block is None and plain.num_blocks == 10 and plain.num_groups == 1
    one_window = KVCacheManager(10, BLOCK_SIZE, KVCacheLayout((KVCacheGroup((0, 1), WINDOW),)))
    assert one_window.policies == [sliding] and one_window.num_blocks == 9
    assert one_window.null_block is one_window.block_pool.blocks[0]


def test_shared_prefix_ref_counts_and_free_order(manager) -> None:
    a = make_request("a", list(range(10)))
    assert run_chunk(manager, a, 10) == [1, 4, 2, 5, 3, 6]  # group 0: 1-3, group 1: 4-6
    pool = manager.block_pool
    assert pool.get_cached_block(a.block_hashes[0]) is pool.blocks[1]
    assert pool.get_cached_block(group_key(a.block_hashes[0], 1)) is pool.blocks[4]
    assert len(pool.cached_block_hash_to_block) == 4  # 2 full blocks in each group
    b = make_request("b", list(range(8)) + [100, 101, 102])
    hits, num_hit = manager.get_computed_blocks(b)
    assert [[blk.block_id for blk in blocks] for blocks in hits] == [[1, 2], [4, 5]]
    assert num_hit == 8 and ref_counts(manager, range(1, 7)) == [1] * 6  # not touched
    assert [blk.block_id for blk in manager.allocate_slots(b, 3, 8, hits) or []] == [7, 8]
    b.num_computed_tokens = 11
    assert manager.get_block_ids("b") == [1, 4, 2, 5, 7, 8]
    assert ref_counts(manager, range(1, 9)) == [2, 2, 1, 2, 2, 1, 1, 1]
    assert manager.num_free_blocks == 12
    # b's next token (11) reads keys 6..11: its sliding block 0 (shared with a) is dropped
    # from b's table, but a still holds it.
    b.append_output_token(103)
    assert run_chunk(manager, b, 1) == []
    assert group_ids(manager, "b") == [[1, 2, 7], [0, 5, 8]]
    assert pool.blocks[4].ref_cnt == 1 and manager.num_free_blocks == 12
    assert pool.get_cached_block(b.block_hashes[2]) is pool.blocks[7]  # full in this step
    # Freed tail first, group by group; the null block never enters the free queue.
    manager.free(a)
    assert free_ids(manager) == [*range(9, 21), 3, 6, 4]
    manager.free(b)
    assert free_ids(manager) == [*range(9, 21), 3, 6, 4, 7, 2, 1, 8, 5]


def test_decode_frees_out_of_window_blocks_every_step(manager) -> None:
    req = make_request("d", list(range(8)))
    assert run_chunk(manager, req, 8) == [1, 3, 2, 4]
    # Per decode step of the token at position 8, 9, ...: (new block ids, group 1's table,
    # free blocks). Most steps take the path that allocates nothing, and still drop blocks.
    expected = [
        ([5, 6], [3, 4, 6], 14),  # 8 reads keys 3..8: nothing to drop, a new block
        ([], [0, 4, 6], 15),  # 9 reads 4..9: block 0 dropped, no new block
        ([], [0, 4, 6], 15),
        ([], [0, 4, 6], 15),  # 11 fills block 2: registered, no new block
        ([7, 8], [0, 4, 6, 8], 13),
        ([], [0, 0, 6, 8], 14),  # 13 reads 8..13: block 1 dropped
    ]
    for new_ids, sliding_ids, num_free in expected:
        req.append_output_token(7)
        assert run_chunk(manager, req, 1) == new_ids
        assert group_ids(manager, "d")[1] == sliding_ids
        assert manager.num_free_blocks == num_free
    assert group_ids(manager, "d")[0] == [1, 2, 5, 7]
    assert manager.block_pool.blocks[5].block_hash is not None  # registered at 12 tokens
    manager.free(req)


def test_failed_allocation_only_frees_skipped_blocks(manager) -> None:
    req = make_request("r", list(range(40)))
    assert run_chunk(manager, req, 16) == [1, 5, 2, 6, 3, 7, 4, 8]
    hog = make_request("hog", list(range(100, 120)))
    assert run_chunk(manager, hog, 20) is not None and manager.num_free_blocks == 2
    # The chunk from 16 reads keys from 11: blocks 0-1 of group 1 go, even though the
    # 2 x 4 new blocks do not fit.
    assert run_chunk(manager, req, 16) is None
    assert req.num_computed_tokens == 16
    assert group_ids(manager, "r") == [[1, 2, 3, 4], [0, 0, 7, 8]]
    assert free_ids(manager) == [19, 20, 6, 5] and pool_refs_ok(manager)
    manager.free(hog)
    assert run_chunk(manager, req, 16) is not None
    manager.free(req)


def test_hit_on_freed_blocks_takes_them_from_the_free_queue(manager) -> None:
    first = make_request("first", list(range(16)))
    assert run_chunk(manager, first, 16) == [1, 5, 2, 6, 3, 7, 4, 8]
    manager.free(first)
    assert free_ids(manager) == [*range(9, 21), 4, 3, 2, 1, 8, 7, 6, 5]
    second = make_request("second", list(range(16)) + [50])
    hits, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 16
    assert [[blk.block_id for blk in blocks] for blocks in hits] == [[1, 2, 3, 4], [0, 0, 7, 8]]
    assert [blk.block_id for blk in manager.allocate_slots(second, 1, 16, hits) or []] == [9, 10]
    assert manager.get_block_ids("second") == [1, 0, 2, 0, 3, 7, 4, 8, 9, 10]
    assert ref_counts(manager, range(1, 11)) == [1, 1, 1, 1, 0, 0, 1, 1, 1, 1]
    assert free_ids(manager) == [*range(11, 21), 6, 5] and pool_refs_ok(manager)
    manager.free(second)
