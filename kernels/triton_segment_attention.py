"""Triton bidirectional attention within packed segments, for the vision towers.

The GPU counterpart of :func:`mm_serve.kernels.varlen_attention.segment_attention_ref`: rows
``[cu_seqlens[i], cu_seqlens[i + 1])`` of ``q, k, v: [N, heads, head_dim]`` attend to each other
(one image, or one Qwen2.5-VL window), scale ``head_dim ** -0.5``. Algorithm: FlashAttention-2
(Tri Dao, arXiv:2307.08691), online softmax in base 2 with ``log2(e)`` folded into the scale;
one program per (query block, segment, head).

Head dims that are not a power of two (Qwen2-VL's 80, SigLIP's 72) are split into two parts
that are, ``DIM_A`` (the largest power of two below the head dim) and ``DIM_B`` (the rest
rounded up to one, at least 16: a tensor-core dot needs 16): 80 = 64 + 16, 72 = 64 + 16 with
8 masked. Each score tile is ``q_a k_a^T + q_b k_b^T`` and each output tile is two dots, so the
multiply-adds are ``DIM_A + DIM_B`` per key rather than the next power of two (128 for 80, what
one padded dot and cuDNN's tile for head dim 80 both pay).

A Triton kernel launched inside a CUDA graph takes no place in the launch queue, where each of
cuDNN's attention nodes takes about two per replay (BENCHMARKS.md, eleventh session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _segment_attention_kernel(
    out_ptr,  # [N, heads, HEAD_DIM]
    q_ptr,
    k_ptr,
    v_ptr,
    cu_seqlens_ptr,  # [num_segments + 1] int32
    scale_log2,
    stride_q,  # row strides (elements); the head stride is given apart, the last dim is 1
    stride_qh,
    stride_k,
    stride_kh,
    stride_v,
    stride_vh,
    stride_o,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    DIM_A: tl.constexpr,
    DIM_B: tl.constexpr,  # 0: the head dim is DIM_A
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN: tl.constexpr,  # every segment's length is a multiple of BLOCK_M and BLOCK_N
):
    q_block = tl.program_id(0)
    segment = tl.program_id(1)
    head = tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + segment)
    length = tl.load(cu_seqlens_ptr + segment + 1) - start
    if q_block * BLOCK_M >= length:
        return
    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < length
    offs_a = tl.arange(0, DIM_A)
    offs_b = DIM_A + tl.arange(0, DIM_B if DIM_B > 0 else 16)
    b_ok = offs_b < HEAD_DIM
    q_rows = q_ptr + (start + rows).to(tl.int64)[:, None] * stride_q + head * stride_qh
    q_a = tl.load(q_rows + offs_a[None, :], mask=row_ok[:, None])
    if DIM_B > 0:
        q_b = tl.load(q_rows + offs_b[None, :], mask=row_ok[:, None] & b_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_a = tl.zeros([BLOCK_M, DIM_A], dtype=tl.float32)
    if DIM_B > 0:
        acc_b = tl.zeros([BLOCK_M, DIM_B], dtype=tl.float32)
    k_head = k_ptr + head * stride_kh
    v_head = v_ptr + head * stride_vh
    for key_start in range(0, length, BLOCK_N):
        cols = key_start + tl.arange(0, BLOCK_N)
        col_ok = cols < length
        key_rows = (start + cols).to(tl.int64)
        k_cols = k_head + key_rows[None, :] * stride_k  # [1, BLOCK_N]: k^T tiles
        v_rows = v_head + key_rows[:, None] * stride_v  # [BLOCK_N, 1]
        if EVEN:
            s = tl.dot(q_a, tl.load(k_cols + offs_a[:, None]))
        else:
            s = tl.dot(q_a, tl.load(k_cols + offs_a[:, None], mask=col_ok[None, :], other=0.0))
        if DIM_B > 0:
            k_b = tl.load(k_cols + offs_b[:, None], mask=b_ok[:, None] & col_ok[None, :], other=0.0)
            s += tl.dot(q_b, k_b)
        s = s * scale_log2
        if not EVEN:
            s = tl.where(col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(q_a.dtype)
        if EVEN:
            v_a = tl.load(v_rows + offs_a[None, :])
        else:
            v_a = tl.load(v_rows + offs_a[None, :], mask=col_ok[:, None], other=0.0)
        acc_a = acc_a * alpha[:, None] + tl.dot(p, v_a)
        if DIM_B > 0:
            v_b = tl.load(v_rows + offs_b[None, :], mask=col_ok[:, None] & b_ok[None, :], other=0.0)
            acc_b = acc_b * alpha[:, None] + tl.dot(p, v_b)
        m_i = m_new

    out_rows = out_ptr + (start + rows).to(tl.int64)[:, None] * stride_o + head * stride_oh
    tl.store(out_rows + offs_a[None, :], (acc_a / l_i[:, None]).to(q_a.dtype), mask=row_ok[:, None])
    if DIM_B > 0:
        out_b = (acc_b / l_i[:, None]).to(q_a.dtype)
        tl.store(out_rows + offs_b[None, :], out_b, mask=row_ok[:, None] & b_ok[None, :])


def head_dim_parts(head_dim: int) -> tuple[int, int]:
    """``(DIM_A, DIM_B)`` for ``head_dim`` (module doc): 80 -> (64, 16), 72 -> (64, 16),
    128 -> (128, 0), 40 -> (32, 16)."""
    dim_a = 1 << (head_dim.bit_length() - 1)
    rest = head_dim - dim_a
    return dim_a, 0 if rest == 0 else max(16, triton.next_power_of_2(rest))


# Tiles measured on an H200 for Qwen2-VL's 16 heads of 80 over 1,024-patch images
# (``mm-serve bench kernels``); (BLOCK_M, BLOCK_N, num_warps, num_stages).
DEFAULT_CONFIG = (128, 64, 8, 3)


def segment_attention_triton(
    q: torch.Tensor,  # [N, heads, head_dim], last dim contiguous
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,  # [num_segments + 1] int32, device
    max_len: int,
    config: tuple[int, int, int, int] = DEFAULT_CONFIG,
) -> torch.Tensor:
    """Attention within each segment (module doc): ``[N, heads, head_dim]``, ``q``'s dtype.

    ``max_len`` is the longest segment; when every segment has ``max_len`` rows and
    ``max_len`` is a multiple of both tiles, the kernel runs without masks. Raises
    ``ValueError`` for a head dim below 16 or strided last dims.
    """
    n, heads, head_dim = q.shape
    if head_dim < 16 or any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError(f"needs head_dim >= 16 and contiguous last dims, got {q.shape}")
    block_m, block_n, num_warps, num_stages = config
    dim_a, dim_b = head_dim_parts(head_dim)
    num_segments = cu_seqlens.shape[0] - 1
    even = max_len * num_segments == n and max_len % block_m == 0 and max_len % block_n == 0
    out = torch.empty(n, heads, head_dim, device=q.device, dtype=q.dtype)
    grid = (triton.cdiv(max_len, block_m), num_segments, heads)
    _segment_attention_kernel[grid](
        out, q, k, v, cu_seqlens, head_dim**-0.5 * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, DIM_A=dim_a, DIM_B=dim_b, BLOCK_M=block_m, BLOCK_N=block_n,
        EVEN=even, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
