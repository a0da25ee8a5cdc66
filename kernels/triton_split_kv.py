"""The second pass of split-KV paged attention (flash-decoding: Tri Dao et al.,
"Flash-Decoding for long-context inference", 2023): merge the per-segment partial outputs of
``triton_attention._paged_attention_kernel`` into one output per query row and head; and the
buffers that hold those partial outputs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mm_serve.kernels.pdl import pdl_enter, pdl_options


def segment_buffers(
    num_tokens: int, num_heads: int, num_segments: int, head_dim_pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 ``(out [T, H, S, head_dim_pad], max [T, H, S], sum [T, H, S])`` for the first
    pass to write and ``merge_segments`` to read."""
    parts = (num_tokens, num_heads, num_segments)
    return (
        torch.empty(*parts, head_dim_pad, dtype=torch.float32, device=device),
        torch.empty(parts, dtype=torch.float32, device=device),
        torch.empty(parts, dtype=torch.float32, device=device),
    )


def merge_segments(out: torch.Tensor, segments: tuple[torch.Tensor, ...], head_dim: int) -> None:
    """Write into ``out`` (``[T, H, head_dim]``) the merge of ``segments`` (``segment_buffers``,
    filled by the first pass)."""
    seg_out, seg_max, seg_sum = segments
    num_tokens, num_heads, num_segments, head_dim_pad = seg_out.shape
    merge_segments_kernel[(num_tokens, num_heads)](
        out, seg_out, seg_max, seg_sum, num_heads, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SEGMENTS=num_segments,
        SEGMENTS_PAD=max(2, triton.next_power_of_2(num_segments)), **pdl_options(out.device),
    )  # fmt: skip


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
