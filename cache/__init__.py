"""KV-cache blocks, prefix-cache hashing and the per-request KV-cache manager (no torch)."""

from mm_serve.cache.block_hash import (
    BlockHash,
    block_extra_keys,
    hash_block_tokens,
    update_block_hashes,
)
from mm_serve.cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from mm_serve.cache.kv_cache_manager import KVCacheManager, PrefixCacheStats

__all__ = [
    "BlockHash",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "block_extra_keys",
    "hash_block_tokens",
    "update_block_hashes",
]
