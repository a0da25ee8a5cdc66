"""Per-request KV-cache block tables on top of the block pool, with prefix caching.

Semantics of vLLM V1's KVCacheManager (vllm/v1/core/kv_cache_manager.py) for one attention
type; paged blocks as in the PagedAttention paper (Kwon et al., SOSP 2023).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mm_serve.cache.block_hash import update_block_hashes
from mm_serve.cache.block_pool import BlockPool, KVCacheBlock

if TYPE_CHECKING:
    from mm_serve.request import Request


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


class KVCacheManagerBase:
    """What every KV-cache manager has: ``block_size``, ``enable_caching``, the prefix-cache
    counters, and the free-block figures of the ``block_pool`` the subclass makes.

    Raises:
        ValueError: if ``block_size`` is not positive.
    """

    block_pool: BlockPool

    def __init__(self, block_size: int, enable_caching: bool) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}.")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks not used by any request (cached ones included)."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests, in [0, 1]."""
        return self.block_pool.usage

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Return the counters gathered since the last call and start new ones."""
        stats, self.stats = self.stats, PrefixCacheStats()
        return stats


class KVCacheManager(KVCacheManagerBase):
    """Gives each request the blocks it needs and shares full blocks through their hashes.

    The scheduler calls ``get_computed_blocks`` once when a request is first scheduled (or
    resumed), ``allocate_slots`` every time it schedules tokens of the request, and ``free``
    when the request finishes or is preempted. The manager keeps ``request.block_hashes`` up to
    date (see ``update_block_hashes``).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        super().__init__(block_size, enable_caching)
        self.num_blocks = num_blocks
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of leading blocks of each request whose hashes were already registered.
        self.num_cached_blocks: dict[str, int] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks ``num_tokens`` tokens of one request occupy."""
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of ``request``: its blocks (not touched) and its tokens.

        The token count is a multiple of ``block_size``. At least one token is always left to
        compute (the model must produce logits), so at most ``(num_tokens - 1) // block_size``
        blocks hit. Nothing is looked up when caching is off or the request wants prompt
        logprobs (those need every prompt token recomputed).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        update_block_hashes(request, self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_computed_tokens = len(blocks) * self.block_size
        self.stats.record_lookup(request.num_tokens, num_computed_tokens)
        return blocks, num_computed_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Give ``request`` blocks for its computed tokens plus ``num_new_tokens`` more tokens.

        ``new_computed_blocks`` / ``num_new_computed_tokens`` are a prefix hit from
        ``get_computed_blocks``; they are touched and appended to the request's blocks. Then
        the hashes of blocks that become full up to ``min(num_computed + num_new_tokens,
        num_tokens)`` tokens are registered: their KV is written in this step's forward pass, so
        a request scheduled later in the same step may already hit them (as in vLLM).

        Returns the newly allocated blocks (without the touched ones), or None — with nothing
        changed — when too few blocks are free.

        Raises:
            ValueError: on a negative token count, or ``num_new_computed_tokens`` that does not
                match ``new_computed_blocks``.
        """
        if not new_computed_blocks and self._fits(request, num_new_tokens):
            return []  # most decode steps: nothing to allocate, no block becomes full
        new_computed_blocks = new_computed_blocks or []
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be non-negative, got {num_new_tokens}.")
        if num_new_computed_tokens != len(new_computed_blocks) * self.block_size:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} does not match "
                f"{len(new_computed_blocks)} computed blocks of {self.block_size} tokens."
            )
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_required_blocks = -(-(num_computed_tokens + num_new_tokens) // self.block_size)
        num_new_blocks = max(num_required_blocks - len(req_blocks) - len(new_computed_blocks), 0)
        # Hit blocks sitting free in the queue leave it when touched: they can't be allocated.
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
            return None

        new_blocks: list[KVCacheBlock] = []
        # Most decode steps need no block: the request's list is then left as it is.
        if new_computed_blocks or num_new_blocks or request.request_id not in self.req_to_blocks:
            self.block_pool.touch(new_computed_blocks)
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
            req_blocks = req_blocks + new_computed_blocks + new_blocks
            self.req_to_blocks[request.request_id] = req_blocks

        if self.enable_caching:
            update_block_hashes(request, self.block_size)
            num_tokens_to_cache = min(num_computed_tokens + num_new_tokens, request.num_tokens)
            num_full_blocks = num_tokens_to_cache // self.block_size
            num_cached = self.num_cached_blocks.get(request.request_id, 0)
            if num_full_blocks > num_cached:
                self.block_pool.cache_full_blocks(
                    req_blocks, request.block_hashes, num_cached, num_full_blocks
                )
                self.num_cached_blocks[request.request_id] = num_full_blocks
        return new_blocks

    def _fits(self, request: Request, num_new_tokens: int) -> bool:
        """Whether ``num_new_tokens`` more tokens fit in the request's blocks and fill none of
        them that is not registered yet (``allocate_slots`` then changes nothing)."""
        req_blocks = self.req_to_blocks.get(request.request_id)
        end = request.num_computed_tokens + num_new_tokens
        if req_blocks is None or num_new_tokens < 0 or len(req_blocks) * self.block_size < end:
            return False
        num_tokens = len(request.all_token_ids)
        num_full_blocks = (end if end < num_tokens else num_tokens) // self.block_size
        return not self.enable_caching or num_full_blocks <= self.num_cached_blocks.get(
            request.request_id, 0
        )

    def free(self, request: Request) -> None:
        """Release the request's blocks (on finish or preemption); no-op if it has none.

        Blocks are freed tail first, so a request's last blocks are evicted before its first
        ones (which other requests are likelier to share). Cached blocks keep their hashes in
        the free queue until evicted.
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The block table of a request: its block ids in token order.

        Raises:
            KeyError: if the request holds no blocks.
        """
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            raise KeyError(f"Request {request_id!r} holds no KV-cache blocks.")
        return [block.block_id for block in blocks]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no request holds blocks. Returns whether it did."""
        return self.block_pool.reset_prefix_cache()
