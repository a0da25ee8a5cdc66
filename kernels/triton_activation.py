"""Triton SiLU-and-mul (the gated MLP activation): the GPU counterpart of ``silu_and_mul_ref``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mm_serve.kernels.pdl import pdl_enter, pdl_options


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,
    x_ptr,
    d,
    stride_x_row,
    stride_o_row,
    ROUND: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + row * stride_x_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x_row + d + offs, mask=mask, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate))
    if ROUND:  # the reference rounds silu's result to the input dtype before the product
        act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o_row + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask
    )


def silu_and_mul_triton(
    x: torch.Tensor,  # [..., 2 * d]
    out: torch.Tensor | None = None,  # [..., d], written
) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` -> ``[..., d]`` in ``x``'s dtype (fp16, bf16, fp32).

    Computed in float32 with silu's result rounded to the input dtype, as the reference's
    two torch ops do. Rows may be strided (last dim contiguous). Returns ``out``.
    """
    d = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if out is None:
        out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    out_rows = out.view(-1, d)
    if rows.shape[0] == 0 or d == 0:
        return out
    block = min(1024, triton.next_power_of_2(d))
    grid = (rows.shape[0], triton.cdiv(d, block))
    _silu_and_mul_kernel[grid](
        out_rows,
        rows,
        d,
        rows.stride(0),
        out_rows.stride(0),
        ROUND=x.dtype != torch.float32,
        BLOCK=block,
        num_warps=4 if block >= 512 else 1,
        **pdl_options(x.device),
    )
    return out


@triton.jit
def _quick_gelu_kernel(out_ptr, x_ptr, n, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    t = xf * 1.702
    if ROUND:  # the reference rounds each op's result to the input dtype
        t = t.to(x.dtype).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-t))
    if ROUND:
        s = s.to(x.dtype).to(tl.float32)
    tl.store(out_ptr + offs, (xf * s).to(out_ptr.dtype.element_ty), mask=mask)


def quick_gelu_triton(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 * x)`` in one pass over ``x`` (any shape; fp16, bf16, fp32), with the
    reference's three roundings to ``x.dtype`` (``quick_gelu_ref``); the reference reads and
    writes the tensor three times."""
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        block = 2048
        _quick_gelu_kernel[(triton.cdiv(n, block),)](
            out, x, n, ROUND=x.dtype != torch.float32, BLOCK=block, num_warps=8
        )
    return out
