"""Paged attention through the ``flash_attn`` package (FlashAttention-2), when installed.

``flash_attn_varlen_func(..., block_table=...)`` computes what ``paged_attention_ref`` does
(causal masks aligned to the end of each request's keys, as here) straight from the paged
cache. Its paged-KV path needs the cache block size to be a multiple of 256 and fp16/bf16;
:func:`flash_attn_unusable_reason` says why it cannot serve a given cache, and the dispatcher
then uses the Triton kernel.
"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.nn.functional as F

from mm_serve.kernels.attention_metadata import AttentionMetadata

FLASH_ATTN_BLOCK_MULTIPLE = 256  # flash_attn's check: "Paged KV cache block size must be ..."


@functools.cache
def flash_attn_varlen() -> object | None:
    """``flash_attn.flash_attn_varlen_func``, or None when the package does not import."""
    try:
        return importlib.import_module("flash_attn").flash_attn_varlen_func
    except Exception:  # not installed, or built for another torch/CUDA: not usable either way
        return None


def flash_attn_unusable_reason(query: torch.Tensor, kv_cache: torch.Tensor) -> str | None:
    """Why flash_attn cannot run this call (a sentence for the log), or None when it can."""
    if flash_attn_varlen() is None:
        return "flash_attn is not installed"
    block_size, head_dim = kv_cache.shape[2], kv_cache.shape[-1]
    if block_size % FLASH_ATTN_BLOCK_MULTIPLE:
        return (
            f"flash_attn's paged KV needs a block size divisible by {FLASH_ATTN_BLOCK_MULTIPLE}, "
            f"the cache has {block_size}"
        )
    if query.dtype not in (torch.float16, torch.bfloat16) or query.dtype != kv_cache.dtype:
        return f"flash_attn needs fp16/bf16, got {query.dtype} / {kv_cache.dtype}"
    if head_dim % 8 or head_dim > 256:
        return f"flash_attn needs head_dim <= 256 divisible by 8, got {head_dim}"
    return None


def paged_attention_flash(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Contract of ``paged_attention_ref`` through ``flash_attn_varlen_func``.

    ``cu_seqlens_k`` (``[num_reqs + 1]`` int32) is the running sum of ``seq_lens``; the block
    table is passed as is. Rows past ``metadata.num_tokens`` are zero. Call only when
    :func:`flash_attn_unusable_reason` returned None.
    """
    num_tokens = metadata.num_tokens
    cu_seqlens_k = F.pad(torch.cumsum(metadata.seq_lens, 0, dtype=torch.int32), (1, 0))
    attn = flash_attn_varlen()(
        query[:num_tokens],
        kv_cache[0],
        kv_cache[1],
        cu_seqlens_q=metadata.query_start_loc,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=metadata.max_query_len,
        max_seqlen_k=metadata.max_seq_len,
        softmax_scale=scale,
        causal=True,
        block_table=metadata.block_table,
    )
    padding = query.shape[0] - num_tokens  # rows of a padded (captured) batch: zero
    return F.pad(attn, (0, 0, 0, 0, 0, padding)) if padding else attn
