"""Triton paged attention for a flattened batch mixing prefill chunks and decode tokens.

The GPU counterpart of :func:`mm_serve.kernels.attention.paged_attention_ref` (same arguments,
same result up to rounding). FlashAttention-2 (arXiv:2307.08691): each program keeps a running
row max ``m``, row sum ``l`` and an unnormalised output over the key tiles (online softmax, base
2 with ``log2(e)`` folded into the scale); K and V are read from the paged cache through the
block table. Work split as vLLM's Triton "unified attention":

- one program per (query block, KV head): up to ``BLOCK_Q`` tokens of one request times the
  ``GROUP`` query heads sharing the KV head (GQA), ``BLOCK_M = BLOCK_Q * GROUP`` rows;
- programs find their request by binary search over ``query_start_loc``;
- split-KV (flash-decoding, Tri Dao et al., 2023): small decode batches cut each request's
  keys into ``num_segments`` ranges, each writing a partial output with its ``(m, l)``; a
  second kernel merges them (``launch_config`` chooses).

Masks beyond causal: a per-row key limit (``AttentionMetadata.key_end``: an image's tokens
attend to each other, Gemma 3), and a sliding window (keys ``k > position - window``, HF's
``sliding_window_overlay``) whose earlier key tiles are never loaded (their blocks may be
freed, ``cache.kv_cache_groups``)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mm_serve.kernels.attention_metadata import AttentionMetadata
from mm_serve.kernels.pdl import pdl_enter, pdl_options
from mm_serve.kernels.triton_split_kv import merge_segments, segment_buffers

LOG2E = 1.4426950408889634
MAX_SEGMENTS = 32


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """Last request ``i`` with ``query_start_loc[i] // BLOCK_Q + i <= q_block`` (binary search).

    Request ``i``'s query blocks are numbered from ``query_start_loc[i] // BLOCK_Q + i``: that
    bound leaves each request at least ``ceil(query_len / BLOCK_Q)`` block ids.
    """
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tiles(
    q,  # [BLOCK_M, HEAD_DIM_PAD]
    q_abs,  # [BLOCK_M] absolute position of each row
    q_end,  # [BLOCK_M] one past the last key of each row (q_abs + 1 when causal)
    win_lo,  # the first key any row sees (0 without a sliding window)
    window,  # the sliding window (used when SLIDING)
    kv_len,
    tile_lo,
    tile_hi,
    bt_row,  # this request's block table row
    k_base,  # K cache at this KV head
    v_base,
    stride_c_block,
    stride_c_slot,
    scale_log2,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr,
):
    """FlashAttention-2 inner loop over key tiles ``[tile_lo, tile_hi)``: row ``r`` sees the
    keys ``k < q_end[r]`` and, when ``SLIDING``, ``k > q_abs[r] - window``; keys outside
    ``[win_lo, kv_len)`` are not loaded.

    Returns the unnormalised output ``acc [BLOCK_M, HEAD_DIM_PAD]``, the running row max ``m``
    (log2 domain, -inf for rows that saw no key) and the row sum ``l``.
    """
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)
        n_ok = (offs_n < kv_len) & (offs_n >= win_lo)
        block = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv_offs = block * stride_c_block + (offs_n % BLOCK_SIZE) * stride_c_slot
        k = tl.load(
            k_base + kv_offs[None, :] + offs_d[:, None],
            mask=d_ok[:, None] & n_ok[None, :],
            other=0.0,
        ).to(q.dtype)  # [HEAD_DIM_PAD, TILE_N]; an FP8 cache read as it is (scale 1)
        v = tl.load(
            v_base + kv_offs[:, None] + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(q.dtype)  # [TILE_N, HEAD_DIM_PAD]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        visible = (offs_n[None, :] < q_end[:, None]) & n_ok[None, :]
        if SLIDING:
            visible = visible & (offs_n[None, :] > q_abs[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_reqs", "stride_bt"])  # per-step values: no compiles mid-serving
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]            (NUM_SEGMENTS == 1)
    seg_out_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS, HEAD_DIM_PAD] fp32 (split)
    seg_max_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] fp32, log2 domain (split)
    seg_sum_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] fp32 (split)
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    key_end_ptr,  # [num_tokens] int32 (HAS_KEY_END)
    scale_log2,
    window,
    num_reqs,
    num_heads,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_KEY_END: tl.constexpr,
    SLIDING: tl.constexpr,
    ONE_QUERY: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # The metadata comes from host copies, never from a kernel: read it before the PDL wait.
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    # With ONE_QUERY (every request has one query) program i serves request i: no search.
    req = q_block if ONE_QUERY else _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_block = 0 if ONE_QUERY else q_block - (q_start // BLOCK_Q + req)
    if local_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    pdl_enter(USE_PDL)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_pos = local_block * BLOCK_Q + offs_m // GROUP  # position inside this step's chunk
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m // GROUP < BLOCK_Q) & (q_pos < query_len)
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_start + q_pos).to(tl.int64)
    q_offs = q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    context_len = seq_len - query_len  # tokens cached before this step's chunk
    q_abs = context_len + q_pos  # absolute position of each row: sees keys 0..q_abs (causal)
    if HAS_KEY_END:
        q_end = tl.load(key_end_ptr + q_rows, mask=row_ok, other=0)
        kv_len = tl.max(tl.where(row_ok, q_end, 0), 0)  # keys any row of this block can see
    else:
        q_end = q_abs + 1
        last_row = tl.minimum(local_block * BLOCK_Q + BLOCK_Q, query_len) - 1
        kv_len = context_len + last_row + 1
    win_lo = 0
    if SLIDING:  # the first row's window start: no row of the block sees a key before it
        win_lo = tl.maximum(context_len + local_block * BLOCK_Q - window + 1, 0)
    tile_start = win_lo // TILE_N
    num_tiles = tl.cdiv(kv_len, TILE_N)
    tiles_per_segment = tl.cdiv(num_tiles - tile_start, NUM_SEGMENTS)
    tile_lo = tile_start + segment * tiles_per_segment
    tile_hi = tl.minimum(tile_lo + tiles_per_segment, num_tiles)

    acc, m_i, l_i = _attend_tiles(
        q,
        q_abs,
        q_end,
        win_lo,
        window,
        kv_len,
        tile_lo,
        tile_hi,
        block_table_ptr + req.to(tl.int64) * stride_bt,
        k_cache_ptr + kv_head * stride_c_head,
        v_cache_ptr + kv_head * stride_c_head,
        stride_c_block,
        stride_c_slot,
        scale_log2,
        HEAD_DIM,
        HEAD_DIM_PAD,
        BLOCK_SIZE,
        BLOCK_M,
        TILE_N,
        DOT_PRECISION,
        SLIDING,
    )

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if NUM_SEGMENTS == 1:
        o_offs = q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
        tl.store(
            out_ptr + o_offs,
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        # Every segment writes its (m, l, out), also an empty one (m = -inf, l = 0, out = 0).
        part = (q_rows * num_heads + head) * NUM_SEGMENTS + segment  # [BLOCK_M]
        tl.store(seg_max_ptr + part, m_i, mask=row_ok)
        tl.store(seg_sum_ptr + part, l_i, mask=row_ok)
        seg_offs = part[:, None] * HEAD_DIM_PAD + offs_d[None, :]
        tl.store(seg_out_ptr + seg_offs, out, mask=row_ok[:, None])


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """The SMs of a CUDA ``device``; a small number for Triton's interpreter on a CPU."""
    if device.type != "cuda":
        return 8  # the CPU interpreter: any small number
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_config(
    group: int, max_query_len: int, max_seq_len: int, num_reqs: int, num_kv_heads: int, device
) -> dict[str, int]:
    """Tile sizes and the number of KV segments for one call, from the step's shape alone.

    Decode-like batches (every request's queries fit one 16-row block) get 16-row blocks and,
    when ``num_reqs * num_kv_heads`` programs cannot fill the GPU, split-KV: enough segments
    for about one wave of 4 programs per SM, each at least 4 key tiles long. Prefill batches
    get 64-row blocks. ``ONE_QUERY`` (one query per request) launches one program per request
    and KV head, which finds its request by index rather than by search.
    """
    rows = triton.next_power_of_2(group)
    decode_like = max_query_len * rows <= max(16, rows)
    block_m = max(16, rows) if decode_like else max(64, rows)
    tile_n = 64
    num_segments = 1
    if decode_like:
        target = 4 * num_sms(device)  # programs in flight that keep HBM busy
        want = target // max(1, num_reqs * num_kv_heads)
        most = max(1, max_seq_len // (4 * tile_n))  # at least 4 tiles per segment
        num_segments = int(max(1, min(want, most, MAX_SEGMENTS)))
    return {
        "BLOCK_M": block_m,
        "TILE_N": tile_n,
        "NUM_SEGMENTS": num_segments,
        "ONE_QUERY": max_query_len == 1,
    }


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim], written
    config: dict[str, int] | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Varlen causal GQA attention over the paged cache; contract of ``paged_attention_ref``
    (``metadata.key_end`` and ``sliding_window`` included).

    Request ``i``'s query rows ``query_start_loc[i]:query_start_loc[i+1]`` attend causally to its
    ``seq_lens[i]`` cached tokens (this step's K/V already written), found through
    ``block_table[i]``. ``query`` and ``kv_cache`` share one dtype (fp16, bf16 or fp32; fp32
    dots in IEEE precision), or the cache is FP8 (e4m3, read in the query's dtype);
    ``head_dim`` <= 256 (any size: the tile is padded to a power of 2 and masked). Rows past
    ``metadata.num_tokens`` are zero. ``config`` overrides the launch heuristics (``BLOCK_M``,
    ``TILE_N``, ``NUM_SEGMENTS``, ``ONE_QUERY`` (only true when every request has one query
    row), ``num_warps``, ``num_stages``); for benchmarks. Returns ``out`` (allocated when
    None).

    Raises ``ValueError`` for mismatched dtypes or head counts/sizes, or a cache whose last dim
    is strided.
    """
    _, num_heads, head_dim = query.shape
    num_kv_heads, cache_head_dim = kv_cache.shape[3:]
    same = kv_cache.dtype in (query.dtype, torch.float8_e4m3fn)
    fits = same and head_dim == cache_head_dim and head_dim <= 256
    if not fits or num_heads % num_kv_heads or kv_cache.stride(-1) != 1:
        raise ValueError(
            f"paged_attention_triton: query {tuple(query.shape)} {query.dtype} does not fit "
            f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} (same dtype and head_dim <= 256, "
            "num_heads a multiple of num_kv_heads, head_dim contiguous)."
        )
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    num_tokens = metadata.num_tokens
    out[num_tokens:].zero_()
    if num_tokens == 0 or metadata.num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    max_keys = metadata.max_seq_len  # the most keys one row reads
    if sliding_window is not None:
        max_keys = min(max_keys, sliding_window + metadata.max_query_len)
    cfg = launch_config(
        group,
        metadata.max_query_len,
        max_keys,
        metadata.num_reqs,
        num_kv_heads,
        query.device,
    )
    cfg.update(config or {})
    _launch(query, kv_cache, metadata, scale, out, group, cfg, sliding_window)
    return out


def _launch(query, kv_cache, metadata, scale, out, group, cfg, sliding_window=None) -> None:
    """Run the attention kernel (and the merge when split) with the launch config ``cfg``."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = kv_cache.shape[3]
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_m, num_segments = cfg["BLOCK_M"], cfg["NUM_SEGMENTS"]
    block_q = block_m // group
    num_tokens, num_reqs = metadata.num_tokens, metadata.num_reqs
    one_query = bool(cfg["ONE_QUERY"])
    num_programs = num_reqs if one_query else num_tokens // block_q + num_reqs
    grid = (num_programs, num_kv_heads, num_segments)
    segments = (out,) * 3  # unused unless split
    if num_segments > 1:
        segments = segment_buffers(num_tokens, num_heads, num_segments, head_dim_pad, query.device)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    key_end = metadata.key_end
    _paged_attention_kernel[grid](
        out,
        *segments,
        query,
        key_cache,
        value_cache,
        metadata.block_table,
        metadata.seq_lens,
        metadata.query_start_loc,
        metadata.query_start_loc if key_end is None else key_end,  # unread without key_end
        scale * LOG2E,
        sliding_window or 0,
        num_reqs,
        num_heads,
        *query.stride()[:2],  # token, head
        *out.stride()[:2],
        *key_cache.stride()[:3],  # block, slot, head
        metadata.block_table.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=cfg["TILE_N"],
        NUM_SEGMENTS=num_segments,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        HAS_KEY_END=key_end is not None,
        SLIDING=sliding_window is not None,
        ONE_QUERY=one_query,
        num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 2),
        **pdl_options(query.device),
    )
    if num_segments > 1:
        merge_segments(out, segments, head_dim)
