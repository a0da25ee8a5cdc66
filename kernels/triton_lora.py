"""Triton LoRA shrink and expand over a batch of mixed adapters (punica's BGMV: each program
gathers its token's adapter by the slot index, so one launch serves every adapter of the
batch); the references and the contract are ``kernels.lora``.

Shrink: one program per (token, ``BLOCK_R`` ranks), streaming ``A``'s rows in ``BLOCK_K``
tiles with elementwise float32 products summed once at the end. Expand: one program per
(token, ``BLOCK_N`` outputs) over the whole rank (``R`` <= 256 fits one tile), adding into
``y``. A token without an adapter (slot -1) loads nothing: shrink stores zeros, expand leaves
``y`` as it is. Both read strided operands (a slice of a fused layer's buffer or ``B``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_shrink_kernel(
    out_ptr, x_ptr, a_ptr, idx_ptr, scale, R, K,
    stride_xt, stride_al, stride_ar, stride_ot,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(idx_ptr + token).to(tl.int64)
    k_end = tl.where(slot >= 0, K, 0)  # no adapter: nothing loaded, zeros stored
    a_rows = a_ptr + tl.maximum(slot, 0) * stride_al + offs_r[:, None] * stride_ar
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        x = tl.load(x_ptr + token * stride_xt + offs_k, mask=k_ok, other=0.0)
        a_ok = (offs_r[:, None] < R) & k_ok[None, :]
        a = tl.load(a_rows + offs_k[None, :], mask=a_ok, other=0.0)
        acc += a.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.sum(acc, 1) * scale
    tl.store(out_ptr + token * stride_ot + offs_r, out, mask=offs_r < R)


@triton.jit
def _lora_expand_kernel(
    y_ptr, buf_ptr, b_ptr, idx_ptr, N, R, offset,
    stride_yt, stride_bt, stride_bl, stride_bn,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    slot = tl.load(idx_ptr + token).to(tl.int64)
    r_ok = offs_r < tl.where(slot >= 0, R, 0)  # no adapter: nothing loaded or stored
    n_ok = offs_n < tl.where(slot >= 0, N, 0)
    buf = tl.load(buf_ptr + token * stride_bt + offs_r, mask=r_ok, other=0.0).to(tl.float32)
    b_rows = b_ptr + tl.maximum(slot, 0) * stride_bl + offs_n[:, None] * stride_bn
    b = tl.load(b_rows + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
    delta = tl.sum(b.to(tl.float32) * buf[None, :], 1)
    y_cols = y_ptr + token * stride_yt + offset + offs_n
    y = tl.load(y_cols, mask=n_ok, other=0.0)
    tl.store(y_cols, (y.to(tl.float32) + delta).to(y.dtype), mask=n_ok)


def lora_shrink_triton(
    x: torch.Tensor, lora_a: torch.Tensor, indices: torch.Tensor, scale: float = 1.0
) -> torch.Tensor:
    """``kernels.lora.lora_shrink_ref`` on the GPU: ``x [T, K]`` (rows strided, K
    contiguous), ``lora_a [max_loras, R, K]`` contiguous, ``indices [T]`` -> ``[T, R]``."""
    num_tokens, k = x.shape
    r = lora_a.shape[1]
    out = torch.empty(num_tokens, r, dtype=x.dtype, device=x.device)
    block_r = min(triton.next_power_of_2(r), 64)
    grid = (num_tokens, triton.cdiv(r, block_r))
    _lora_shrink_kernel[grid](
        out, x, lora_a, indices, scale, r, k,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0),
        BLOCK_R=block_r, BLOCK_K=64,
    )  # fmt: skip
    return out


def lora_expand_triton(
    buf: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor, y: torch.Tensor, offset: int = 0
) -> None:
    """``kernels.lora.lora_expand_ref`` on the GPU, in place: ``buf [T, R]`` (columns
    contiguous), ``lora_b [max_loras, N, R]`` (R contiguous), ``y [T, >= offset + N]``."""
    num_tokens, r = buf.shape
    n = lora_b.shape[1]
    if buf.stride(-1) != 1:
        buf = buf.contiguous()
    block_n = 64
    grid = (num_tokens, triton.cdiv(n, block_n))
    _lora_expand_kernel[grid](
        y, buf, lora_b, indices, n, r, offset,
        y.stride(0), buf.stride(0), lora_b.stride(0), lora_b.stride(1),
        BLOCK_N=block_n, BLOCK_R=triton.next_power_of_2(r),
    )  # fmt: skip
