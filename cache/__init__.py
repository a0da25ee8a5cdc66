"""KV-cache blocks, prefix-cache hashing, the per-request KV-cache manager and its policy per
attention type, the image content hash and the processor cache (no torch)."""

from mm_serve.cache.block_hash import (
    BlockHash,
    block_extra_keys,
    hash_block_tokens,
    update_block_hashes,
)
from mm_serve.cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from mm_serve.cache.kv_cache_manager import KVCacheManager, PrefixCacheStats
from mm_serve.cache.kv_cache_policies import (
    AttentionPolicy,
    FullAttentionPolicy,
    SlidingWindowPolicy,
)
from mm_serve.cache.mm_hash import MultiModalHasher
from mm_serve.cache.processor_cache import ProcessorCache

__all__ = [
    "AttentionPolicy",
    "BlockHash",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "FullAttentionPolicy",
    "KVCacheBlock",
    "KVCacheManager",
    "MultiModalHasher",
    "PrefixCacheStats",
    "ProcessorCache",
    "SlidingWindowPolicy",
    "block_extra_keys",
    "hash_block_tokens",
    "update_block_hashes",
]
