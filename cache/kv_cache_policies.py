"""What one KV-cache group's attention type means for its blocks: which cached blocks a prefix
hit needs, and which blocks no query reads any more.

The ``KVCacheManager`` drives one policy per KV-cache group (``cache.kv_cache_groups``), as
vLLM V1's ``KVCacheCoordinator`` drives one ``SingleTypeKVCacheManager`` per group
(vllm/v1/core/single_type_kv_cache_manager.py). A new attention type is one new policy class.
Policies hold no per-request state: the manager keeps the block tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from mm_serve.cache.block_hash import BlockHash
from mm_serve.cache.block_pool import BlockPool, KVCacheBlock
from mm_serve.cache.kv_cache_groups import KVCacheGroup


class AttentionPolicy:
    """The block rules of one attention type (subclasses are frozen dataclasses)."""

    # Whether the group frees blocks that fall behind every query (``num_skipped_blocks``);
    # such a group needs the pool's ``null_block`` to stand in for them.
    skips_blocks: ClassVar[bool] = False

    def find_cache_hit(
        self, pool: BlockPool, hashes: Sequence[BlockHash], limit: int
    ) -> list[KVCacheBlock]:
        """The group's longest usable prefix hit of at most ``limit`` blocks.

        ``hashes[i]`` is the group's prefix-cache key of block ``i`` (``len(hashes) >=
        limit``). Position ``i`` of the result is the cached block of ``hashes[i]``, or
        ``pool.null_block`` where the first token after the hit reads nothing of block ``i``.
        The blocks are not touched.
        """
        raise NotImplementedError

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks that no query from position ``num_computed_tokens`` on reads."""
        return 0


@dataclass(frozen=True)
class FullAttentionPolicy(AttentionPolicy):
    """Every query reads every earlier token: a hit is a run of cached blocks from block 0."""

    def find_cache_hit(
        self, pool: BlockPool, hashes: Sequence[BlockHash], limit: int
    ) -> list[KVCacheBlock]:
        blocks = []
        for i in range(limit):
            block = pool.get_cached_block(hashes[i])
            if block is None:
                break
            blocks.append(block)
        return blocks


@dataclass(frozen=True)
class SlidingWindowPolicy(AttentionPolicy):
    """A query at position ``q`` reads the keys ``k > q - sliding_window`` (HF's window).

    A hit of ``n`` blocks needs only the blocks of the window of position ``n * block_size``:
    the last ``ceil((sliding_window - 1) / block_size)`` of them, the ones before being the
    null block. Blocks that end before the window of the first token to compute are freed.
    """

    skips_blocks: ClassVar[bool] = True
    sliding_window: int  # tokens
    block_size: int  # tokens

    def find_cache_hit(
        self, pool: BlockPool, hashes: Sequence[BlockHash], limit: int
    ) -> list[KVCacheBlock]:
        needed = -(-(self.sliding_window - 1) // self.block_size)
        blocks = [pool.null_block] * limit
        if needed == 0:
            return blocks
        run = 0  # cached blocks in a row, scanning from the end
        for i in range(limit - 1, -1, -1):
            block = pool.get_cached_block(hashes[i])
            if block is None:
                run = 0
                continue
            blocks[i] = block
            run += 1
            if run >= needed:
                return blocks[: i + run]
        return blocks[:run]  # the window reaches back to block 0: a shorter run will do

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size


def policy_for(group: KVCacheGroup, block_size: int) -> AttentionPolicy:
    """The policy of ``group``'s attention type, for blocks of ``block_size`` tokens."""
    if group.sliding_window is None:
        return FullAttentionPolicy()
    return SlidingWindowPolicy(group.sliding_window, block_size)
