"""The KV-cache manager of a model with several KV-cache groups (``kv_cache_groups``): one
block table per group over one block pool, sliding-window groups freeing what falls out of
their window.

Semantics of vLLM V1's hybrid KV cache manager (``KVCacheCoordinator`` with a
``FullAttentionManager`` and ``SlidingWindowManager`` per group), for groups of one block size:

- Every group's table of a request has one entry per ``block_size`` tokens, so a step gives
  each group the same number of new blocks. The block ids travel to the model runner
  *interleaved*: for each block position, one id per group (``[b0g0, b0g1, ..., b1g0, ...]``),
  so that appending a step's ids keeps the layout (one group: exactly the block ids).
- A sliding-window group of window ``W`` frees, each time the request is scheduled, the blocks
  entirely before ``num_computed_tokens - W + 1`` (no query from there on sees them) and puts
  the pool's ``null_block`` in their place; the model runner keeps the stale ids, which the
  attention kernels never read (they start at the window).
- Prefix caching: each group keys its cached blocks by the block hash and its group index. A
  hit of ``n`` blocks needs, in every full-attention group, blocks ``0..n-1``; in a sliding
  group only the last ``ceil((W - 1) / block_size)`` of them (the window of the first token to
  compute), the ones before it being ``null_block``. The longest such ``n`` is found by
  lowering ``n`` until every group agrees.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from mm_serve.cache.block_hash import BlockHash, update_block_hashes
from mm_serve.cache.block_pool import BlockPool, KVCacheBlock
from mm_serve.cache.kv_cache_groups import KVCacheLayout
from mm_serve.cache.kv_cache_manager import KVCacheManager, KVCacheManagerBase

if TYPE_CHECKING:
    from mm_serve.request import Request

GroupBlocks = list[list[KVCacheBlock]]  # [group][block position]


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of ``block_hash`` in group ``group`` (group 0: the hash itself)."""
    return block_hash if group == 0 else BlockHash(block_hash + group.to_bytes(2, "little"))


class _GroupHashes(Sequence):
    """``block_hashes`` as group ``group``'s keys (for ``BlockPool.cache_full_blocks``)."""

    def __init__(self, block_hashes: Sequence[BlockHash], group: int) -> None:
        self.block_hashes, self.group = block_hashes, group

    def __len__(self) -> int:
        return len(self.block_hashes)

    def __getitem__(self, i):  # type: ignore[override]
        return group_key(self.block_hashes[i], self.group)


class HybridKVCacheManager(KVCacheManagerBase):
    """``KVCacheManager``'s contract (the scheduler sees no difference) for a layout of several
    groups; ``get_computed_blocks`` returns one block list per group, which
    ``allocate_slots`` takes back as they are.

    ``num_blocks`` counts the blocks requests can hold (the pool's, less its null block).
    """

    def __init__(
        self, num_blocks: int, block_size: int, layout: KVCacheLayout, enable_caching: bool = True
    ) -> None:
        super().__init__(block_size, enable_caching)
        self.block_pool = BlockPool(num_blocks, enable_caching, reserve_null_block=True)
        self.null_block = self.block_pool.null_block
        self.num_blocks = self.block_pool.num_usable_blocks
        self.windows = [group.sliding_window for group in layout.groups]
        self.num_groups = len(self.windows)
        self.req_to_blocks: dict[str, GroupBlocks] = {}
        self.num_cached_blocks: dict[str, list[int]] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks ``num_tokens`` tokens of one request occupy at most (every group's)."""
        return self.num_groups * -(-num_tokens // self.block_size)

    # ---- prefix cache ----------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The longest prefix of ``request`` that every group can take from the cache: the
        blocks per group (not touched; ``null_block`` where a sliding group needs none) and the
        tokens, a multiple of ``block_size`` below ``num_tokens`` (see the module doc)."""
        empty: GroupBlocks = [[] for _ in self.windows]
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return empty, 0
        update_block_hashes(request, self.block_size)
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        num_hit = len(hashes)
        while True:  # each group's hit within the others': lengths only fall, so it ends
            hits = [self._group_hit(hashes, num_hit, g) for g in range(self.num_groups)]
            shortest = min(len(blocks) for blocks in hits)
            if shortest == num_hit:
                break
            num_hit = shortest
        self.stats.record_lookup(request.num_tokens, num_hit * self.block_size)
        return (hits if num_hit else empty), num_hit * self.block_size

    def _group_hit(self, hashes: Sequence[BlockHash], limit: int, group: int) -> list:
        """Group ``group``'s longest usable hit of at most ``limit`` blocks."""
        pool, window = self.block_pool, self.windows[group]
        if window is None:  # full attention: every block of the prefix
            blocks = []
            for block_hash in hashes[:limit]:
                block = pool.get_cached_block(group_key(block_hash, group))
                if block is None:
                    break
                blocks.append(block)
            return blocks
        needed = -(-(window - 1) // self.block_size)  # blocks of the first query's window
        blocks = [self.null_block] * limit
        run = 0  # cached blocks in a row, scanning from the end
        if needed == 0:
            return blocks
        for i in range(limit - 1, -1, -1):
            block = pool.get_cached_block(group_key(hashes[i], group))
            if block is None:
                run = 0
                continue
            blocks[i] = block
            run += 1
            if run >= needed:
                return blocks[: i + run]
        return blocks[:run]  # the window reaches back to the first block: a shorter run will do

    # ---- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: GroupBlocks | None = None,
    ) -> list[KVCacheBlock] | None:
        """``KVCacheManager.allocate_slots`` for every group: first the sliding groups free
        the blocks before the window of the first token to compute; then each group gets the
        same number of new blocks. Returns the new blocks interleaved (module doc), or None —
        having only freed out-of-window blocks — when too few blocks are free.

        Raises:
            ValueError: a negative token count, or ``num_new_computed_tokens`` that does not
                match ``new_computed_blocks``.
        """
        hits = new_computed_blocks or [[] for _ in self.windows]
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be non-negative, got {num_new_tokens}.")
        if num_new_computed_tokens != len(hits[0]) * self.block_size:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} does not match "
                f"{len(hits[0])} computed blocks of {self.block_size} tokens."
            )
        req_id = request.request_id
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        groups = self.req_to_blocks.get(req_id)
        if groups is not None:
            self._free_out_of_window(groups, num_computed)
        held = len(groups[0]) if groups is not None else 0
        required = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(required - held - len(hits[0]), 0)
        real_hits = [b for blocks in hits for b in blocks if b is not self.null_block]
        num_evictable = sum(1 for block in real_hits if block.ref_cnt == 0)
        if num_new_blocks * self.num_groups > self.num_free_blocks - num_evictable:
            return None
        self.block_pool.touch(real_hits)
        fresh = self.block_pool.get_new_blocks(num_new_blocks * self.num_groups)
        new = [fresh[g * num_new_blocks : (g + 1) * num_new_blocks] for g in range(self.num_groups)]
        if groups is None:
            groups = self.req_to_blocks[req_id] = [[] for _ in self.windows]
            self.num_cached_blocks[req_id] = [len(blocks) for blocks in hits]
        for g, blocks in enumerate(groups):
            blocks += hits[g] + new[g]
        if self.enable_caching:
            self._cache_full_blocks(request, groups, num_computed + num_new_tokens)
        return [new[g][i] for i in range(num_new_blocks) for g in range(self.num_groups)]

    def _free_out_of_window(self, groups: GroupBlocks, num_computed: int) -> None:
        """Swap the null block in for each sliding group's blocks that end before the window of
        position ``num_computed``, and free them."""
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            blocks = groups[g]
            first_needed = max(0, num_computed - window + 1) // self.block_size
            removed = []
            for i in range(min(first_needed, len(blocks)) - 1, -1, -1):
                if blocks[i] is self.null_block:
                    break  # everything before it is already freed
                removed.append(blocks[i])
                blocks[i] = self.null_block
            if removed:
                self.block_pool.free_blocks(removed)

    def _cache_full_blocks(self, request: Request, groups: GroupBlocks, num_tokens: int) -> None:
        """Register the hashes of each group's blocks that are full within ``num_tokens``."""
        update_block_hashes(request, self.block_size)
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        cached = self.num_cached_blocks[request.request_id]
        for g, blocks in enumerate(groups):
            if num_full > cached[g]:  # nulls lie below cached[g]: freed blocks were full
                hashes = _GroupHashes(request.block_hashes, g)
                self.block_pool.cache_full_blocks(blocks, hashes, cached[g], num_full)
                cached[g] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks in every group (tail first); no-op if it has none."""
        groups = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        for blocks in groups or ():
            self.block_pool.free_blocks(b for b in reversed(blocks) if b is not self.null_block)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids, interleaved by group (module doc; null blocks as 0).

        Raises:
            KeyError: if the request holds no blocks.
        """
        groups = self.req_to_blocks.get(request_id)
        if groups is None:
            raise KeyError(f"Request {request_id!r} holds no KV-cache blocks.")
        return [block.block_id for position in zip(*groups, strict=True) for block in position]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no request holds blocks. Returns whether it did."""
        return self.block_pool.reset_prefix_cache()


def make_kv_cache_manager(
    num_blocks: int, block_size: int, enable_caching: bool, layout: KVCacheLayout | None = None
) -> KVCacheManager | HybridKVCacheManager:
    """``KVCacheManager`` for one KV-cache group (no layout), else ``HybridKVCacheManager``."""
    if layout is None or layout.num_groups == 1:
        return KVCacheManager(num_blocks, block_size, enable_caching)
    return HybridKVCacheManager(num_blocks, block_size, layout, enable_caching)
