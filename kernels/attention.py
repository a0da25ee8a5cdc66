"""Pure-torch references for the paged KV cache: the cache write and paged attention.

These run on the CPU path and define what the Triton kernels must compute. The layout is the
one of :class:`mm_serve.kernels.attention_metadata.AttentionMetadata`: one layer's cache is
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V). An FP8 cache
(float8_e4m3fn, ``--kv-cache-dtype fp8``) holds K and V rounded to e4m3 and saturated at
+-448 (as the GPU's ``satfinite`` conversion does), with a scale of 1.0; attention reads them
back as they are.
"""

from __future__ import annotations

import torch

from mm_serve.kernels.attention_metadata import AttentionMetadata


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
    flat[0, slots] = to_cache_dtype(key[valid], kv_cache.dtype)
    flat[1, slots] = to_cache_dtype(value[valid], kv_cache.dtype)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the cache's ``dtype``; FP8 saturates at its largest finite value."""
    if dtype == torch.float8_e4m3fn:
        limit = torch.finfo(dtype).max
        x = x.float().clamp(-limit, limit)
    return x.to(dtype)


def gather_kv_ref(
    kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int, first_block: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request's tokens ``first_block * block_size .. seq_len - 1``, each
    ``[seq_len - first_block * block_size, kv_heads, head_dim]`` (the blocks before
    ``first_block`` are not read: a sliding window's freed blocks)."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table_row[first_block:num_blocks].long()
    kv = kv_cache[:, blocks].flatten(1, 2)[:, : seq_len - first_block * block_size]
    return kv[0], kv[1]


def causal_attention_ref(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    key: torch.Tensor,  # [num_keys, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_keys, num_kv_heads, head_dim]
    scale: float,
    key_end: torch.Tensor | None = None,  # [query_len]
    sliding_window: int | None = None,
    key_start: int = 0,
) -> torch.Tensor:
    """Causal GQA attention of the *last* ``query_len`` tokens of a sequence, in float32.

    The keys are the sequence's positions ``key_start .. seq_len - 1`` (``seq_len = key_start
    + num_keys``); query row ``j`` sits at position ``p = seq_len - query_len + j`` and sees
    the keys at positions ``k < key_end[j]`` (default ``p + 1``: causal) with, for a sliding
    window ``W``, ``k > p - W`` (HF's ``sliding_window_overlay``). Returns ``[query_len,
    num_heads, head_dim]`` in the query's dtype.
    """
    query_len, num_heads, _ = query.shape
    num_keys, num_kv_heads, _ = key.shape
    seq_len = key_start + num_keys
    group = num_heads // num_kv_heads  # query heads h uses KV head h // group, as HF repeat_kv
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
    k_pos = torch.arange(key_start, seq_len, device=query.device)
    end = q_pos + 1 if key_end is None else key_end.to(q_pos.device, q_pos.dtype)
    hidden = k_pos[None, :] >= end[:, None]
    if sliding_window is not None:
        hidden |= k_pos[None, :] <= q_pos[:, None] - sliding_window
    scores.masked_fill_(hidden, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)


def first_window_block(first_query: int, sliding_window: int | None, block_size: int) -> int:
    """The first block any query from position ``first_query`` on reads: 0 without a window,
    else the block of ``first_query - sliding_window + 1`` (blocks before it may be freed)."""
    if sliding_window is None:
        return 0
    return max(0, first_query - sliding_window + 1) // block_size


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Varlen causal attention over the paged cache for a mixed prefill/chunk/decode batch.

    Request ``i``'s queries (rows ``query_start_loc[i]:query_start_loc[i+1]``) attend causally
    to its ``seq_lens[i]`` cached tokens (which must already include this step's K/V), up to
    ``metadata.key_end`` where it is set, and within ``sliding_window`` keys of their own
    position where that is set (see ``causal_attention_ref``; only the blocks of the window are
    read). Returns ``[num_tokens, num_heads, head_dim]``; rows past ``metadata.num_tokens``
    stay zero.
    """
    out = torch.zeros_like(query)
    starts = metadata.query_start_loc_cpu
    block_size = kv_cache.shape[2]
    decodes = []
    if metadata.key_end is None and sliding_window is None:
        decodes = [i for i in range(metadata.num_reqs) if starts[i + 1] - starts[i] == 1]
        if decodes:
            rows = torch.tensor([starts[i] for i in decodes], device=query.device)
            out[rows] = decode_attention_ref(query[rows], kv_cache, metadata, decodes, scale)
    for i in sorted(set(range(metadata.num_reqs)) - set(decodes)):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        seq_len = metadata.seq_lens_cpu[i]
        first = first_window_block(seq_len - (end - start), sliding_window, block_size)
        key, value = gather_kv_ref(kv_cache, metadata.block_table[i], seq_len, first)
        key_end = None if metadata.key_end is None else metadata.key_end[start:end]
        out[start:end] = causal_attention_ref(
            query[start:end], key, value, scale, key_end, sliding_window, first * block_size
        )
    return out


def decode_attention_ref(
    query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    reqs: list[int],  # the requests of the step (indices into metadata) whose query is one token
    scale: float,
) -> torch.Tensor:
    """Causal attention of requests' one query token (a decode step) to all their cached
    tokens, batched: the keys gathered from the block tables, padded to the longest and masked.
    Returns ``[num_decodes, num_heads, head_dim]`` in the query's dtype.

    Computed in float64 and rounded: the padding length depends on the other requests of the
    step, and float64 keeps a request's result the same whatever its batch (as the
    one-request-at-a-time loop of ``paged_attention_ref`` is).
    """
    num_decodes, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    seq_lens = torch.tensor([metadata.seq_lens_cpu[i] for i in reqs], device=query.device)
    num_blocks = -(-int(seq_lens.max()) // block_size)
    index = torch.tensor(reqs, device=query.device)
    blocks = metadata.block_table[index, :num_blocks].flatten().long()
    # index_select, not kv_cache[:, blocks]: several times faster on the CPU
    kv = kv_cache.flatten(2).index_select(1, blocks).to(torch.float64)
    kv = kv.view(2, num_decodes, num_blocks * block_size, num_kv_heads, head_dim)
    hidden = torch.arange(kv.shape[2], device=query.device) >= seq_lens[:, None]  # [reqs, keys]
    kv[1].masked_fill_(hidden[:, :, None, None], 0.0)  # the padding may hold NaN
    group = num_heads // num_kv_heads  # query head h uses KV head h // group, as HF repeat_kv
    q = query.to(torch.float64).view(num_decodes, num_kv_heads, group, head_dim) * scale
    out = torch.empty_like(q)
    for h in range(num_kv_heads):  # strided views of one head: bmm reads them without a copy
        scores = q[:, h] @ kv[0, :, :, h].transpose(1, 2)  # [reqs, group, keys]
        probs = scores.masked_fill_(hidden[:, None], float("-inf")).softmax(dim=-1)
        out[:, h] = probs @ kv[1, :, :, h]
    return out.view(num_decodes, num_heads, head_dim).to(query.dtype)
