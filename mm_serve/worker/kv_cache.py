"""Sizing and allocating the paged KV cache of one device."""

from __future__ import annotations

import logging

import torch

from mm_serve.config import EngineConfig

logger = logging.getLogger(__name__)


def kv_block_bytes(config: EngineConfig) -> int:
    """Bytes of one KV block over all layers: 2 (K, V) x layers x block x kv heads x head dim."""
    model = config.model
    element_size = torch.empty((), dtype=model.dtype).element_size()
    per_layer = 2 * config.cache.block_size * model.num_kv_heads * model.head_dim * element_size
    return per_layer * model.num_layers


def encoder_cache_bytes(config: EngineConfig) -> int:
    """Bytes the encoder cache can hold: ``encoder_cache_size`` embeddings of the LM's hidden
    size in the model dtype (0 for a text-only model)."""
    element_size = torch.empty((), dtype=config.model.dtype).element_size()
    hidden = config.model.text_config.hidden_size
    return config.scheduler.encoder_cache_size * hidden * element_size


def determine_num_kv_blocks(config: EngineConfig, model: torch.nn.Module) -> int:
    """The KV pool size in blocks.

    ``cache.num_kv_blocks`` wins when set. Otherwise on CPU the pool takes
    ``cache.cpu_kv_cache_bytes``; on CUDA, ``gpu_memory_utilization`` of the device memory minus
    what the process already holds (weights) and the encoder cache's reserve. Either way it is
    capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens can use, so a tiny
    model does not get millions of blocks.

    Raises:
        ValueError: if not even one sequence of ``max_model_len`` tokens fits.
    """
    cache = config.cache
    blocks_per_seq = -(-config.model.max_model_len // cache.block_size)
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if config.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(config.device)
        budget = total * cache.gpu_memory_utilization - (total - free)
        budget -= encoder_cache_bytes(config)
    else:
        budget = cache.cpu_kv_cache_bytes
    num_blocks = int(budget // kv_block_bytes(config))
    num_blocks = min(num_blocks, blocks_per_seq * config.scheduler.max_num_seqs)
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"The KV cache fits {num_blocks} blocks, fewer than one sequence of max_model_len="
            f"{config.model.max_model_len} needs ({blocks_per_seq}); lower max_model_len or "
            "give the cache more memory."
        )
    logger.info("KV cache: %d blocks of %d tokens", num_blocks, cache.block_size)
    return num_blocks


def allocate_kv_caches(config: EngineConfig, num_blocks: int) -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer."""
    model = config.model
    shape = (2, num_blocks, config.cache.block_size, model.num_kv_heads, model.head_dim)
    return [
        torch.zeros(shape, dtype=model.dtype, device=config.device) for _ in range(model.num_layers)
    ]
