"""Sizing and allocating the paged KV cache of one device."""

from __future__ import annotations

import logging
import math
import mmap
import os

import torch

from mm_serve.cache.kv_cache_groups import KVCacheLayout, kv_cache_layout
from mm_serve.config import EngineConfig

logger = logging.getLogger(__name__)


def kv_heads_per_rank(config: EngineConfig) -> int:
    """The KV heads one tensor-parallel rank holds: its share, or one replicated head when
    the ranks outnumber them (``QKVParallelLinear``)."""
    return max(1, config.model.num_kv_heads // config.parallel.tensor_parallel_size)


def kv_cache_dtype(config: EngineConfig) -> torch.dtype:
    """The KV cache's dtype: the model's, or float8_e4m3fn for ``kv_cache_dtype`` "fp8".

    Raises ``ValueError`` for FP8 on a CUDA device without FP8 support (before sm_89)."""
    if config.cache.kv_cache_dtype == "auto":
        return config.model.dtype
    device = config.device
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"kv_cache_dtype='fp8' needs an sm_89+ GPU; {device} is older.")
    return torch.float8_e4m3fn


def kv_block_bytes(config: EngineConfig) -> int:
    """Bytes of one KV block over the layers of a KV-cache group (all layers when there is
    one group, ``cache.kv_cache_groups``), on one rank: 2 (K, V) x layers x block x the rank's
    kv heads x head dim."""
    model = config.model
    element_size = torch.empty((), dtype=kv_cache_dtype(config)).element_size()
    kv_heads = kv_heads_per_rank(config)
    per_layer = 2 * config.cache.block_size * kv_heads * model.head_dim * element_size
    return per_layer * kv_cache_layout(model.hf_config).layers_per_group


def encoder_cache_bytes(config: EngineConfig, model: torch.nn.Module | None = None) -> int:
    """Bytes the encoder cache can hold: ``encoder_cache_size`` embeddings of ``model``'s
    ``inputs_embeds_size`` (the LM's hidden size without a model; wider for Qwen3-VL's
    DeepStack rows) in the model dtype (0 for a text-only model)."""
    element_size = torch.empty((), dtype=config.model.dtype).element_size()
    width = getattr(model, "inputs_embeds_size", None) or config.model.text_config.hidden_size
    return config.scheduler.encoder_cache_size * width * element_size


def determine_num_kv_blocks(config: EngineConfig, model: torch.nn.Module) -> int:
    """The KV pool size in blocks.

    ``cache.num_kv_blocks`` wins when set. Otherwise the pool holds what ``max_num_seqs``
    sequences of ``max_model_len`` tokens can use at most, in every KV-cache group (so a small
    model gets no more than it can ever fill), within a budget: on CPU
    ``cache.cpu_kv_cache_bytes``, and never more than half the memory available now; on CUDA
    ``gpu_memory_utilization`` of the device memory minus what the process already holds
    (weights) and the encoder cache's reserve.

    Raises:
        ValueError: if not even one sequence of ``max_model_len`` tokens fits.
    """
    cache = config.cache
    num_groups = kv_cache_layout(config.model.hf_config).num_groups
    blocks_per_seq = num_groups * -(-config.model.max_model_len // cache.block_size)
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if config.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(config.device)
        budget = total * cache.gpu_memory_utilization - (total - free)
        budget -= encoder_cache_bytes(config, model)
    else:
        budget = min(cache.cpu_kv_cache_bytes, available_memory_bytes() // 2)
    block_bytes = kv_block_bytes(config)
    num_blocks = min(int(budget // block_bytes), blocks_per_seq * config.scheduler.max_num_seqs)
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"The KV cache fits {num_blocks} blocks, fewer than one sequence of max_model_len="
            f"{config.model.max_model_len} needs ({blocks_per_seq}); lower max_model_len or "
            "give the cache more memory."
        )
    logger.info(
        "KV cache: %d blocks of %d tokens (%d tokens, %.0f MiB)",
        num_blocks,
        cache.block_size,
        num_blocks * cache.block_size,
        num_blocks * block_bytes / 2**20,
    )
    return num_blocks


def available_memory_bytes() -> int:
    """Memory the system can give without swapping (``MemAvailable``; free pages elsewhere)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def allocate_kv_caches(config: EngineConfig, num_blocks: int) -> list[torch.Tensor]:
    """One zeroed ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer of a
    KV-cache group (``num_kv_heads`` of this rank): per layer with one group; with several,
    layer ``j`` of every group shares tensor ``j`` (``cache.kv_cache_groups``).

    On CPU the memory is an anonymous mapping, which the kernel hands out zeroed one page at
    a time as blocks are first written: the process's resident memory grows with the blocks
    used, up to the pool's size, rather than all at start-up.
    """
    model = config.model
    shape = (2, num_blocks, config.cache.block_size, kv_heads_per_rank(config), model.head_dim)
    num_tensors = kv_cache_layout(model.hf_config).layers_per_group
    dtype = kv_cache_dtype(config)
    if config.device.type == "cpu":
        return [_zeros_on_demand(shape, dtype) for _ in range(num_tensors)]
    return [torch.zeros(shape, dtype=dtype, device=config.device) for _ in range(num_tensors)]


def bind_kv_caches(
    model: torch.nn.Module, kv_caches: list[torch.Tensor], layout: KVCacheLayout
) -> None:
    """Give each attention layer of ``model`` its KV tensor and KV-cache group: tensor ``j``
    of ``kv_caches`` (``allocate_kv_caches``) to the ``j``-th layer of every group.

    Raises:
        ValueError: a layer whose ``sliding_window`` differs from its group's.
    """
    slots = layout.layer_slots()
    model.bind_kv_cache([kv_caches[index] for _, index in slots])
    for i, (attn, (group, _)) in enumerate(zip(model.attention_layers(), slots, strict=True)):
        window = layout.groups[group].sliding_window
        if attn.sliding_window != window:
            raise ValueError(
                f"Layer {i} has sliding window {attn.sliding_window}, its KV-cache group {window}."
            )
        attn.kv_cache_group = group


def _zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose pages are committed on first write (a private anonymous
    mmap; the tensor keeps the mapping alive)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)
