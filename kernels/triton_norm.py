"""Triton RMSNorm and LayerNorm with the residual add fused in: the GPU counterparts of
``rms_norm_ref`` and ``layer_norm_ref``.

RMSNorm: Zhang & Sennrich, "Root Mean Square Layer Normalization", arXiv:1910.07467; numerics
of HF ``LlamaRMSNorm`` (normalise in float32, cast back, then multiply by the weight).
LayerNorm: Ba et al., "Layer Normalization", arXiv:1607.06450; numerics of ``torch.nn.
LayerNorm`` on fp16/bf16 (mean, variance and the affine map in float32, one cast at the end).

Fusing the add saves one pass over the activations: a pre-norm block's ``x + attn(...)`` then
``norm(x)`` reads two tensors and writes two, where the add and the norm apart read three and
write two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mm_serve.kernels.pdl import pdl_enter, pdl_options


@triton.jit
def _norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    bias_ptr,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    LAYER_NORM: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # add in x's dtype
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if LAYER_NORM:
        h = tl.where(mask, h - tl.sum(h, 0) / hidden, 0.0)
        var = tl.sum(h * h, 0) / hidden
        b = tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        out = h * tl.rsqrt(var + eps) * w + b
    else:
        var = tl.sum(h * h, 0) / hidden
        out = w * (h * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    rows = t.reshape(-1, hidden)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm_triton(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden], x's dtype
    out: torch.Tensor | None = None,  # [..., hidden], written
    residual_out: torch.Tensor | None = None,  # [..., hidden], written
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * x / rms(x)``; contract of ``rms_norm_ref``.

    With ``residual``: ``x = x + residual`` (rounded to x's dtype) first, and returns
    ``(rms_norm(x), x)``. The output dtype is ``torch.result_type(weight, x)``, as the
    reference's ``weight * h.to(dtype)``. One program per row; hidden up to 65536.
    """
    dtype = torch.result_type(weight, x)
    return _norm(x, weight, None, eps, residual, out, residual_out, dtype)


def layer_norm_triton(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    bias: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden], x's dtype
    out: torch.Tensor | None = None,  # [..., hidden], written
    residual_out: torch.Tensor | None = None,  # [..., hidden], written
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim, in x's dtype;
    contract of ``layer_norm_ref``. With ``residual``: ``x = x + residual`` (rounded to x's
    dtype) first, and returns ``(layer_norm(x), x)``. One program per row; hidden up to 65536.
    """
    return _norm(x, weight, bias, eps, residual, out, residual_out, x.dtype)


def _norm(x, weight, bias, eps, residual, out, residual_out, dtype):
    """One launch of ``_norm_kernel`` (LayerNorm when ``bias`` is given, else RMSNorm)."""
    hidden = x.shape[-1]
    rows = _rows(x, hidden)
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if residual is not None and residual_out is None:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out_rows = out.view(-1, hidden)
    res_rows = _rows(residual, hidden) if residual is not None else rows
    res_out_rows = residual_out.view(-1, hidden) if residual is not None else out_rows
    if rows.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        _norm_kernel[(rows.shape[0],)](
            out_rows,
            res_out_rows,
            rows,
            res_rows,
            weight,
            weight if bias is None else bias,
            hidden,
            eps,
            rows.stride(0),
            res_rows.stride(0),
            out_rows.stride(0),
            res_out_rows.stride(0),
            HAS_RESIDUAL=residual is not None,
            LAYER_NORM=bias is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
            **pdl_options(x.device),
        )
    return out if residual is None else (out, residual_out)
