"""Per-request KV-cache block tables on top of the block pool, with prefix caching, for every
KV-cache group of a model (``cache.kv_cache_groups``).

Semantics of vLLM V1's ``KVCacheManager`` and ``KVCacheCoordinator``
(vllm/v1/core/kv_cache_manager.py, kv_cache_coordinator.py) for groups of one block size; paged
blocks as in the PagedAttention paper (Kwon et al., SOSP 2023). Each group's attention type is
a policy (``cache.kv_cache_policies``); a model of one attention type has one group.

- Every group's table of a request has one entry per ``block_size`` tokens, so a step gives
  each group the same number of new blocks. The block ids travel to the model runner
  *interleaved*: for each block position, one id per group (``[b0g0, b0g1, ..., b1g0, ...]``),
  so that appending a step's ids keeps the layout (one group: exactly the block ids).
- A group whose policy skips blocks (sliding window) frees, each time the request is scheduled,
  the blocks no query from the first token to compute on reads, and puts the pool's
  ``null_block`` in their place; the model runner keeps the stale ids, which the attention
  kernels never read. The pool reserves the null block (block 0) only for such layouts.
- Prefix caching: each group keys its cached blocks by the block hash and its group index
  (``group_key``). A hit of ``n`` blocks needs each group's policy to find ``n`` usable
  blocks; the longest such ``n`` is found by lowering ``n`` until every group agrees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mm_serve.cache.block_hash import BlockHash, update_block_hashes
from mm_serve.cache.block_pool import BlockPool, KVCacheBlock
from mm_serve.cache.kv_cache_groups import KVCacheGroup, KVCacheLayout
from mm_serve.cache.kv_cache_policies import AttentionPolicy, policy_for

if TYPE_CHECKING:
    from mm_serve.messages.request import Request

GroupBlocks = list[list[KVCacheBlock]]  # [group][block position]


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters since the last ``make_prefix_cache_stats()`` (units: tokens)."""

    requests: int = 0  # lookups made
    queries: int = 0  # tokens looked up (whole request lengths)
    hits: int = 0  # tokens found in the cache

    @property
    def hit_rate(self) -> float:
        """``hits / queries``; 0.0 before any query."""
        return self.hits / self.queries if self.queries else 0.0

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one lookup of a ``num_tokens``-token request that found ``num_hit_tokens``."""
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hit_tokens


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of ``block_hash`` in group ``group`` (group 0: the hash itself)."""
    return block_hash if group == 0 else BlockHash(block_hash + group.to_bytes(2, "little"))


class _GroupHashes(Sequence):
    """``block_hashes`` as group ``group``'s keys, computed when read (integer indices)."""

    def __init__(self, block_hashes: Sequence[BlockHash], group: int) -> None:
        self.block_hashes, self.group = block_hashes, group

    def __len__(self) -> int:
        return len(self.block_hashes)

    def __getitem__(self, i):  # type: ignore[override]
        return group_key(self.block_hashes[i], self.group)


def group_hashes(block_hashes: Sequence[BlockHash], group: int) -> Sequence[BlockHash]:
    """Group ``group``'s prefix-cache keys of ``block_hashes`` (group 0: the list itself)."""
    return block_hashes if group == 0 else _GroupHashes(block_hashes, group)


class KVCacheManager:
    """Gives each request the blocks it needs in every KV-cache group and shares full blocks
    through their hashes.

    The scheduler calls ``get_computed_blocks`` once when a request is first scheduled (or
    resumed), ``allocate_slots`` every time it schedules tokens of the request, and ``free``
    when the request finishes or is preempted. The manager keeps ``request.block_hashes`` up to
    date (see ``update_block_hashes``). ``req_to_blocks[request_id][g]`` is group ``g``'s
    block table of a request, valid until its next ``allocate_slots`` or ``free``.

    Args:
        num_blocks: blocks of the pool (``num_blocks`` below: those requests can hold, one
            less when the layout needs the null block).
        block_size: tokens per block.
        layout: the KV-cache groups; None: one full-attention group.
        enable_caching: prefix caching on.

    Raises:
        ValueError: if ``block_size`` or the usable ``num_blocks`` is not positive.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        layout: KVCacheLayout | None = None,
        enable_caching: bool = True,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}.")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.stats = PrefixCacheStats()
        groups = layout.groups if layout is not None else (KVCacheGroup(()),)
        self.policies: list[AttentionPolicy] = [policy_for(g, block_size) for g in groups]
        # (group, policy) of the groups that free blocks behind their queries.
        self._skipping = [(g, p) for g, p in enumerate(self.policies) if p.skips_blocks]
        self.block_pool = BlockPool(num_blocks, enable_caching, bool(self._skipping))
        self.null_block = self.block_pool.null_block
        self.num_blocks = self.block_pool.num_usable_blocks
        self.req_to_blocks: dict[str, GroupBlocks] = {}
        # Number of leading blocks of each request whose hashes were already registered.
        self.num_cached_blocks: dict[str, int] = {}
        # The scheduler's decode fast path: request id -> the largest ``num_computed_tokens +
        # num_new_tokens`` that ``allocate_slots`` serves with no work (``slot_limit``).
        self.slot_limits: dict[str, int] = {}

    @property
    def num_groups(self) -> int:
        """KV-cache groups: block tables per request."""
        return len(self.policies)

    @property
    def num_free_blocks(self) -> int:
        """Blocks not used by any request (cached ones included)."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests, in [0, 1]."""
        return self.block_pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks ``num_tokens`` tokens of one request occupy at most (every group's)."""
        return self.num_groups * -(-num_tokens // self.block_size)

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Return the counters gathered since the last call and start new ones."""
        stats, self.stats = self.stats, PrefixCacheStats()
        return stats

    # ---- prefix cache ----------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The longest cached prefix of ``request`` that every group can use: per group its
        blocks (not touched; ``null_block`` where a group reads nothing of a block) and the
        prefix's tokens.

        The token count is a multiple of ``block_size``. At least one token is always left to
        compute (the model must produce logits), so at most ``(num_tokens - 1) // block_size``
        blocks hit. Nothing is looked up (every group's list empty) when caching is off or the
        request wants prompt logprobs (those need every prompt token recomputed).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [[] for _ in self.policies], 0
        update_block_hashes(request, self.block_size)
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        num_hit = len(hashes)
        while True:  # each group's hit within the others': lengths only fall, so it ends
            hits = [
                policy.find_cache_hit(self.block_pool, group_hashes(hashes, g), num_hit)
                for g, policy in enumerate(self.policies)
            ]
            num_hit = min(len(blocks) for blocks in hits)
            if all(len(blocks) == num_hit for blocks in hits):
                break
        self.stats.record_lookup(request.num_tokens, num_hit * self.block_size)
        return hits, num_hit * self.block_size

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no request holds blocks. Returns whether it did."""
        return self.block_pool.reset_prefix_cache()

    # ---- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: GroupBlocks | None = None,
    ) -> list[KVCacheBlock] | None:
        """Give ``request`` blocks for its computed tokens plus ``num_new_tokens`` more tokens,
        in every group.

        First the groups that skip blocks free those behind the first token to compute.
        ``new_computed_blocks`` / ``num_new_computed_tokens`` are a prefix hit from
        ``get_computed_blocks``; they are touched and appended to the request's blocks. Then
        each group gets the same number of new blocks, and the hashes of blocks that become
        full up to ``min(num_computed + num_new_tokens, num_tokens)`` tokens are registered:
        their KV is written in this step's forward pass, so a request scheduled later in the
        same step may already hit them (as in vLLM).

        Returns the newly allocated blocks (without the touched ones) interleaved by group, or
        None — having changed nothing but the freeing of skipped blocks — when too few blocks
        are free.

        Raises:
            ValueError: on a negative token count, or ``num_new_computed_tokens`` that does not
                match ``new_computed_blocks``.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be non-negative, got {num_new_tokens}.")
        if num_new_computed_tokens or new_computed_blocks:
            self._check_hit(num_new_computed_tokens, new_computed_blocks)
        groups = self.req_to_blocks.get(request.request_id)
        if groups is not None:
            if self._skipping:
                num_computed = request.num_computed_tokens + num_new_computed_tokens
                self._free_skipped_blocks(groups, num_computed)
            if not new_computed_blocks and self._fits(request, groups, num_new_tokens):
                return []  # most decode steps: nothing to allocate, no block becomes full
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        hits = new_computed_blocks or [[] for _ in self.policies]
        held = len(groups[0]) if groups is not None else 0
        required = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(required - held - len(hits[0]), 0)
        real_hits = [b for blocks in hits for b in blocks if b is not self.null_block]
        # Hit blocks sitting free in the queue leave it when touched: they can't be allocated.
        num_evictable = sum(1 for block in real_hits if block.ref_cnt == 0)
        if num_new_blocks * self.num_groups > self.num_free_blocks - num_evictable:
            return None
        self.block_pool.touch(real_hits)
        new = self._append_blocks(request.request_id, groups, hits, num_new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, num_computed + num_new_tokens)
        if not self._skipping:
            self.slot_limits[request.request_id] = self.slot_limit(request.request_id)
        return [new[g][i] for i in range(num_new_blocks) for g in range(self.num_groups)]

    def slot_limit(self, request_id: str) -> int:
        """The largest ``num_computed_tokens + num_new_tokens`` up to which ``allocate_slots``
        (without a prefix hit) neither allocates nor registers a block of the request: its
        held slots, and with prefix caching one token short of filling its first unregistered
        block. A lower bound: ``allocate_slots`` may also do nothing a little past it. Layouts
        that skip blocks have none (0): their blocks change as the window moves."""
        if self._skipping or request_id not in self.req_to_blocks:
            return 0
        held = len(self.req_to_blocks[request_id][0]) * self.block_size
        if not self.enable_caching:
            return held
        return min(held, (self.num_cached_blocks[request_id] + 1) * self.block_size - 1)

    def _check_hit(self, num_new_computed_tokens: int, hits: GroupBlocks | None) -> None:
        """Raise ``ValueError`` if a prefix hit's token count does not match its blocks."""
        num_hit_blocks = len(hits[0]) if hits else 0
        if num_new_computed_tokens != num_hit_blocks * self.block_size:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} does not match "
                f"{num_hit_blocks} computed blocks of {self.block_size} tokens."
            )

    def _fits(self, request: Request, groups: GroupBlocks, num_new_tokens: int) -> bool:
        """Whether ``num_new_tokens`` more tokens fit in the request's blocks and fill none of
        them that is not registered yet (``allocate_slots`` then changes nothing)."""
        end = request.num_computed_tokens + num_new_tokens
        if len(groups[0]) * self.block_size < end:
            return False
        num_tokens = len(request.all_token_ids)
        num_full_blocks = (end if end < num_tokens else num_tokens) // self.block_size
        return (
            not self.enable_caching or num_full_blocks <= self.num_cached_blocks[request.request_id]
        )

    def _append_blocks(
        self, request_id: str, groups: GroupBlocks | None, hits: GroupBlocks, num_new: int
    ) -> GroupBlocks:
        """Append to each group's table of the request its hit blocks and ``num_new`` new
        blocks (taken for group 0 first); returns the new blocks per group."""
        fresh = self.block_pool.get_new_blocks(num_new * self.num_groups)
        new = [fresh[g * num_new : (g + 1) * num_new] for g in range(self.num_groups)]
        if groups is None:
            groups = self.req_to_blocks[request_id] = [[] for _ in self.policies]
            self.num_cached_blocks[request_id] = len(hits[0])  # hits are cached already
        for g, blocks in enumerate(groups):
            blocks += hits[g] + new[g]
        return new

    def _free_skipped_blocks(self, groups: GroupBlocks, num_computed: int) -> None:
        """Swap the null block in for the blocks each skipping group no longer reads from
        position ``num_computed`` on, and free them (last first)."""
        for g, policy in self._skipping:
            blocks = groups[g]
            removed = []
            for i in range(min(policy.num_skipped_blocks(num_computed), len(blocks)) - 1, -1, -1):
                if blocks[i] is self.null_block:
                    break  # everything before it is already freed
                removed.append(blocks[i])
                blocks[i] = self.null_block
            if removed:
                self.block_pool.free_blocks(removed)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the hashes of each group's blocks that are full within ``num_tokens``
        (skipped blocks lie below the registered ones: they were full)."""
        update_block_hashes(request, self.block_size)
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        num_cached = self.num_cached_blocks[request.request_id]
        if num_full <= num_cached:
            return
        for g, blocks in enumerate(self.req_to_blocks[request.request_id]):
            hashes = group_hashes(request.block_hashes, g)
            self.block_pool.cache_full_blocks(blocks, hashes, num_cached, num_full)
        self.num_cached_blocks[request.request_id] = num_full

    # ---- release and read-out ------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Release the request's blocks (on finish or preemption); no-op if it has none.

        Each group's blocks are freed tail first, so a request's last blocks are evicted before
        its first ones (which other requests are likelier to share). Cached blocks keep their
        hashes in the free queue until evicted.
        """
        groups = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.slot_limits.pop(request.request_id, None)
        for blocks in groups or ():
            self.block_pool.free_blocks(b for b in reversed(blocks) if b is not self.null_block)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids in token order, interleaved by group (module doc; the null
        block as 0). Valid until the request's next ``allocate_slots`` or ``free``.

        Raises:
            KeyError: if the request holds no blocks.
        """
        groups = self.req_to_blocks.get(request_id)
        if groups is None:
            raise KeyError(f"Request {request_id!r} holds no KV-cache blocks.")
        return [block.block_id for position in zip(*groups, strict=True) for block in position]
