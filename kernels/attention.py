"""Pure-torch references for the paged KV cache: the cache write and paged attention.

These run on the CPU path and define what the Triton kernels must compute. The layout is the
one of :class:`mm_serve.attention.AttentionMetadata`: one layer's cache is
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V).
"""

from __future__ import annotations

import torch

from mm_serve.attention import AttentionMetadata


def reshape_and_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset
) -> None:
    """Write each token's K/V into its flat slot of ``kv_cache`` (in place).

    Rows past ``len(slot_mapping)`` (padding of a captured batch) and slots < 0 are skipped.
    """
    num_slots = slot_mapping.numel()
    key, value = key[:num_slots], value[:num_slots]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0, slots] = key[valid].to(kv_cache.dtype)
    flat[1, slots] = value[valid].to(kv_cache.dtype)


def gather_kv_ref(
    kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request's first ``seq_len`` tokens, each ``[seq_len, kv_heads, head_dim]``."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table_row[:num_blocks].long()
    kv = kv_cache[:, blocks].flatten(1, 2)[:, :seq_len]  # [2, seq_len, num_kv_heads, head_dim]
    return kv[0], kv[1]


def causal_attention_ref(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    key: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention of the *last* ``query_len`` tokens of a sequence, in float32.

    Query row ``j`` sits at position ``seq_len - query_len + j`` and sees keys ``0..`` that
    position. Returns ``[query_len, num_heads, head_dim]`` in the query's dtype.
    """
    query_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads  # query heads h uses KV head h // group, as HF repeat_kv
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
    k_pos = torch.arange(seq_len, device=query.device)
    scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Varlen causal attention over the paged cache for a mixed prefill/chunk/decode batch.

    Request ``i``'s queries (rows ``query_start_loc[i]:query_start_loc[i+1]``) attend causally
    to its ``seq_lens[i]`` cached tokens (which must already include this step's K/V). Returns
    ``[num_tokens, num_heads, head_dim]``; rows past ``metadata.num_tokens`` stay zero.
    """
    out = torch.zeros_like(query)
    starts = metadata.query_start_loc_cpu
    for i in range(metadata.num_reqs):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        key, value = gather_kv_ref(kv_cache, metadata.block_table[i], metadata.seq_lens_cpu[i])
        out[start:end] = causal_attention_ref(query[start:end], key, value, scale)
    return out
