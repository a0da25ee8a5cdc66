"""The pool of paged KV-cache blocks: ref counts, the free queue and the prefix-cache map.

Blocks as in the PagedAttention paper (Kwon et al., SOSP 2023); the free queue, lazy LRU
eviction and hash map follow vLLM V1 (vllm/v1/core/block_pool.py and kv_cache_utils.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from mm_serve.cache.block_hash import BlockHash

logger = logging.getLogger(__name__)


class KVCacheBlock:
    """One block of ``block_size`` token slots in the paged KV cache.

    ``block_hash`` is set while the block is full and registered in the prefix cache; it stays
    set after the block is freed, until the block is evicted (reused for new tokens).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # Links of the free queue; both None while the block is not in it.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"hashed={self.block_hash is not None})"
        )


class FreeKVCacheBlockQueue:
    """Doubly linked list of the free blocks (ref_cnt 0), in eviction order.

    Allocation takes from the head, freeing appends to the tail, and a prefix hit removes a
    block from the middle, all in O(1) — which a ``deque`` cannot do. Fake head/tail sentinels
    remove the empty-list special cases.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block (the first to evict).

        Raises:
            ValueError: if the queue is empty.
        """
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("No free KV-cache blocks left.")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the ``n`` head blocks, in queue order.

        Raises:
            ValueError: if fewer than ``n`` blocks are free.
        """
        if n > self.num_free_blocks:
            raise ValueError(f"Asked for {n} free blocks, only {self.num_free_blocks} left.")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue.

        Raises:
            ValueError: if the block is not in the queue.
        """
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"Block {block.block_id} is not in the free queue.")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (the last to evict)."""
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append ``blocks`` at the tail, in the given order."""
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks from head to tail (O(n); for tests and debugging)."""
        blocks = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            blocks.append(block)
            block = block.next_free
        return blocks


class BlockPool:
    """All KV-cache blocks, their ref counts, the free queue and the hash → block map.

    Blocks are allocated from the free-queue head and freed to its tail; a freed block keeps
    its hash (a later request may hit it) until it is popped for reuse, when it is evicted
    from the map (lazy LRU eviction, vLLM V1).

    ``null_block`` (block 0 when ``reserve_null_block``, else None) is never allocated, freed
    or hashed: it stands in the block tables of sliding-window groups for blocks that fell out
    of the window (``kv_cache_manager``), and is never read.
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, reserve_null_block: bool = False
    ) -> None:
        if num_blocks <= int(reserve_null_block):
            raise ValueError(f"num_blocks must be positive, got {num_blocks - reserve_null_block}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0] if reserve_null_block else None
        self.num_usable_blocks = num_blocks - int(reserve_null_block)
        self.free_block_queue = FreeKVCacheBlockQueue(
            self.blocks[num_blocks - self.num_usable_blocks :]
        )
        # One block per hash: a duplicate full block stays un-hashed (see cache_full_blocks).
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, cached or not (all of them can be allocated)."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the free-queue head, evicting their hashes; ref_cnt 1.

        Raises:
            ValueError: if fewer than ``num_blocks`` blocks are free.
        """
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding the KV of ``block_hash``, in use or free; None on a miss."""
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register the hashes of ``blocks[num_cached_blocks:num_full_blocks]`` (newly full).

        ``block_hashes[i]`` is the hash of ``blocks[i]``. A block that already carries a hash
        (a prefix hit) is skipped. When a hash is already mapped to *another* block — two
        requests computed the same content in the same step — the existing mapping is kept and
        the new block stays un-hashed: it is then freed like any private block, and the map
        never holds two blocks per hash.
        """
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:
                continue
            block_hash = block_hashes[i]
            if block_hash in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; those reaching 0 go to the free-queue tail in order.

        Raises:
            ValueError: if a block is already free (a double free).
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"Double free of KV-cache block {block.block_id}.")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no block is in use. Returns whether it reset."""
        num_used = self.num_usable_blocks - self.num_free_blocks
        if num_used > 0:
            logger.warning("Cannot reset the prefix cache: %d blocks are still in use.", num_used)
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True
