"""The second pass of split-KV paged attention (flash-decoding: Tri Dao et al.,
"Flash-Decoding for long-context inference", 2023): merge the per-segment partial outputs of
``triton_attention._paged_attention_kernel`` into one output per query row and head."""

from __future__ import annotations

import triton
import triton.language as tl

from mm_serve.kernels.pdl import pdl_enter


@triton.jit
def merge_segments_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    seg_out_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS, HEAD_DIM_PAD] fp32
    seg_max_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] fp32 (log2 domain)
    seg_sum_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] fp32
    num_heads,
    stride_o_tok,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    SEGMENTS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``out = sum_s w_s * out_s / sum_s w_s`` with ``w_s = l_s * 2^(m_s - max_s m_s)``."""
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SEGMENTS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_ok = offs_s < NUM_SEGMENTS
    part = (token * num_heads + head) * NUM_SEGMENTS + offs_s
    m = tl.load(seg_max_ptr + part, mask=s_ok, other=float("-inf"))
    l = tl.load(seg_sum_ptr + part, mask=s_ok, other=0.0)  # noqa: E741
    w = l * tl.exp2(m - tl.max(m, 0))  # a row's own key is in some segment: max(m) finite
    o = tl.load(
        seg_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], mask=s_ok[:, None], other=0.0
    )
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(
        out_ptr + token * stride_o_tok + head * stride_o_head + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )
