"""Triton GEMV: a linear layer for one token, ``y = W x + b`` (the decode step at batch 1).

Bound by the weight bytes over the memory bandwidth. Each program owns ``BLOCK_N`` output
features and streams their rows of ``W`` in ``BLOCK_K`` tiles; products accumulate elementwise
in float32 and are summed over K once at the end (no cross-warp reduction between weight
loads). The first weight tile is loaded before waiting on the previous kernel (weights are never
written; :mod:`mm_serve.kernels.pdl`).

``GATED`` fuses the activation in front of ``down_proj``: ``x = [gate | up]`` of width ``2 K``,
the product uses ``silu(gate) * up`` rounded as ``silu_and_mul_triton``, so the result equals
the unfused pair up to summation order. ``NORM`` fuses the RMSNorm (and residual add) in front
of ``qkv_proj`` and ``gate_up_proj``: each program reads the whole input row for its RMS, then
normalises each tile as it loads it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mm_serve.kernels.pdl import pdl_enter, pdl_options

MAX_NORM_FEATURES = 8192  # every program of the fused RMSNorm reads the whole row


@triton.jit
def _load_x(
    x_ptr, res_ptr, norm_w_ptr, rstd, offs_k, K,
    GATED: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, OUT_DTYPE: tl.constexpr,
):  # fmt: skip
    """The GEMV input at ``offs_k`` in float32, rounded as the unfused kernels round it:
    ``x``; with ``GATED``, ``silu(gate) * up``; with ``NORM``, ``w * (h * rstd)`` for
    ``h = x + residual`` (``rms_norm_triton``)."""
    k_ok = offs_k < K
    x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)
    if GATED:  # x holds the gate; the up half starts K elements later
        gate = x.to(tl.float32)
        up = tl.load(x_ptr + K + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(OUT_DTYPE).to(tl.float32)
        x = (act * up).to(OUT_DTYPE)
    if NORM:
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + offs_k, mask=k_ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(OUT_DTYPE)
        normed = (x.to(tl.float32) * rstd).to(OUT_DTYPE).to(tl.float32)
        w = tl.load(norm_w_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        x = (w * normed).to(OUT_DTYPE)
    return x.to(tl.float32)


@triton.jit
def _rms_norm_rstd(
    x_ptr, res_ptr, res_out_ptr, eps, K,
    HAS_RESIDUAL: tl.constexpr, ROW: tl.constexpr, OUT_DTYPE: tl.constexpr,
):  # fmt: skip
    """``1 / rms(h)`` of the row ``h = x + residual`` (rounded to the dtype first); program 0
    stores ``h``. ``ROW`` covers the row (a few KiB from L2, read by every program)."""
    offs = tl.arange(0, ROW)
    k_ok = offs < K
    h = tl.load(x_ptr + offs, mask=k_ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs, mask=k_ok, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(OUT_DTYPE)
        if tl.program_id(0) == 0:
            tl.store(res_out_ptr + offs, h, mask=k_ok)
    h = h.to(tl.float32)
    return tl.rsqrt(tl.sum(h * h, 0) / K + eps)


@triton.jit
def _gemv_kernel(
    y_ptr,  # [N]
    x_ptr,  # [K] ([2K] when GATED)
    w_ptr,  # [N, K], rows strided, K contiguous
    b_ptr,  # [N] or unused
    res_ptr,  # [K] residual (NORM and HAS_RESIDUAL) or unused
    res_out_ptr,  # [K] x + residual, written (NORM and HAS_RESIDUAL) or unused
    norm_w_ptr,  # [K] RMSNorm weight (NORM) or unused
    eps,
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROW: tl.constexpr,  # next power of 2 >= K (NORM)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n[:, None] < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    offs_k = tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + offs_k[None, :], mask=n_ok & (offs_k[None, :] < K), other=0.0)
    pdl_enter(USE_PDL)
    dtype = y_ptr.dtype.element_ty
    rstd = 0.0
    if NORM:
        rstd = _rms_norm_rstd(x_ptr, res_ptr, res_out_ptr, eps, K, HAS_RESIDUAL, ROW, dtype)
    x = _load_x(x_ptr, res_ptr, norm_w_ptr, rstd, offs_k, K, GATED, NORM, HAS_RESIDUAL, dtype)
    acc = x[None, :] * w.to(tl.float32)
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=NUM_STAGES):
        offs = k0 + offs_k
        w = tl.load(w_rows + offs[None, :], mask=n_ok & (offs[None, :] < K), other=0.0)
        x = _load_x(x_ptr, res_ptr, norm_w_ptr, rstd, offs, K, GATED, NORM, HAS_RESIDUAL, dtype)
        acc += x[None, :] * w.to(tl.float32)
    out = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, out.to(dtype), mask=offs_n < N)


def gemv_config(out_features: int, in_features: int) -> dict[str, int]:
    """Launch config (``BLOCK_N``, ``BLOCK_K``, ``num_warps``, ``num_stages``) for a weight
    ``[N, K]``, from a sweep on Qwen2-VL-2B's layers (H200, with PDL; BENCHMARKS.md):
    rows up to 2048 long are loaded whole before the wait on the previous kernel; longer
    rows (``down_proj``) and many rows (``gate_up_proj``) stream through a pipelined loop."""
    if in_features > 4096:
        return {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 3}
    if out_features > 4096:
        return {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4, "num_stages": 3}
    block_k = min(2048, triton.next_power_of_2(in_features))
    return {"BLOCK_N": 4, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 1}


def gemv_triton(
    x: torch.Tensor,  # [1, K] ([1, 2K] when gated)
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    gated: bool = False,
    out: torch.Tensor | None = None,  # [1, N], written
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` -> ``[1, N]`` in ``x``'s dtype for one token; with ``gated``,
    the input is ``silu(x[:, :K]) * x[:, K:]`` (the rounding of ``silu_and_mul_triton``).

    fp16, bf16 or fp32 (float32 accumulation); the weight's last dim must be contiguous.
    ``config`` overrides :func:`gemv_config` (for benchmarks). Returns ``out`` (allocated
    when None). Raises ``ValueError`` for more than one row, mismatched shapes or a strided
    weight row.
    """
    _check(x, weight, 2 if gated else 1)
    return _launch(x, weight, bias, out, config, GATED=gated)


def rms_norm_gemv_triton(
    x: torch.Tensor,  # [1, K]
    residual: torch.Tensor | None,  # [1, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    config: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm linear for one token: ``(linear(rms_norm(h)), h)`` with ``h = x + residual``
    (``x`` without one); ``rms_norm_triton`` then ``gemv_triton`` in one kernel.

    All tensors share ``x``'s dtype; ``K <= MAX_NORM_FEATURES``; ``config`` as in
    ``gemv_triton``. Raises ``ValueError`` as
    ``gemv_triton`` does, or for a row longer than that.
    """
    _check(x, weight, 1)
    if x.shape[1] > MAX_NORM_FEATURES:
        raise ValueError(f"rms_norm_gemv_triton: rows up to {MAX_NORM_FEATURES}, got {x.shape}.")
    res_out = x if residual is None else torch.empty_like(x)
    res = x if residual is None else residual.contiguous()
    y = _launch(x, weight, bias, None, config, NORM=True, HAS_RESIDUAL=residual is not None,
                residual=res, residual_out=res_out, norm_weight=norm_weight, eps=eps)  # fmt: skip
    return y, res_out


def _check(x: torch.Tensor, weight: torch.Tensor, width: int) -> None:
    if x.shape != (1, weight.shape[1] * width) or weight.stride(-1) != 1:
        raise ValueError(
            f"gemv: x {tuple(x.shape)} (one row) does not fit weight {tuple(weight.shape)}, "
            "or the weight's rows are strided."
        )


def _launch(x, weight, bias, out, config, residual=None, residual_out=None, norm_weight=None,
            eps=0.0, GATED=False, NORM=False, HAS_RESIDUAL=False) -> torch.Tensor:  # fmt: skip
    out_features, in_features = weight.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(1, out_features, dtype=x.dtype, device=x.device) if out is None else out
    cfg = gemv_config(out_features, in_features) | (config or {})
    _gemv_kernel[(triton.cdiv(out_features, cfg["BLOCK_N"]),)](
        y,
        x,
        weight,
        bias if bias is not None else y,
        residual if residual is not None else y,
        residual_out if residual_out is not None else y,
        norm_weight if norm_weight is not None else y,
        eps,
        out_features,
        in_features,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        GATED=GATED,
        NORM=NORM,
        HAS_RESIDUAL=HAS_RESIDUAL,
        ROW=triton.next_power_of_2(in_features),
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        NUM_STAGES=cfg["num_stages"],
        num_warps=cfg["num_warps"],
        **pdl_options(x.device),
    )
    return y
