"""Triton GEMV: a linear layer for one token, ``y = W x + b`` (the decode step at batch 1).

For one token a linear layer reads its whole weight to do two FLOPs per weight: its time is the
weight bytes over the memory bandwidth. cuBLAS comes close on the MLP's large matrices but not
on the attention's small ones, and it splits ``down_proj`` over K with a second reduction
kernel (measured in ``mm_serve.benchmarks.gemv``). Here each program owns ``BLOCK_N`` output
features and streams their rows of ``W`` in ``BLOCK_K`` tiles; the products accumulate
elementwise in float32 and are summed over K once at the end (a sum per tile would put a
cross-warp reduction between consecutive weight loads). The first weight tile is loaded before
waiting on the previous kernel (weights are never written; see :mod:`mm_serve.kernels.pdl`).

``GATED`` fuses the MLP activation in front of ``down_proj``: ``x = [gate | up]`` of width
``2 K`` and the product uses ``silu(gate) * up``, computed and rounded as
``silu_and_mul_triton`` does, so the result equals the unfused pair up to summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mm_serve.kernels.pdl import pdl_enter, pdl_options


@triton.jit
def _load_x(x_ptr, offs_k, K, GATED: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """``x[offs_k]`` in float32; with ``GATED``, ``silu(gate) * up`` rounded as the unfused."""
    k_ok = offs_k < K
    x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    if GATED:  # x holds the gate; the up half starts K elements later
        up = tl.load(x_ptr + K + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        act = (x / (1.0 + tl.exp(-x))).to(OUT_DTYPE).to(tl.float32)
        x = (act * up).to(OUT_DTYPE).to(tl.float32)
    return x


@triton.jit
def _gemv_kernel(
    y_ptr,  # [N]
    x_ptr,  # [K] ([2K] when GATED)
    w_ptr,  # [N, K], rows strided, K contiguous
    b_ptr,  # [N] or unused
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
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
    acc = _load_x(x_ptr, offs_k, K, GATED, dtype)[None, :] * w.to(tl.float32)
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=NUM_STAGES):
        offs = k0 + offs_k
        w = tl.load(w_rows + offs[None, :], mask=n_ok & (offs[None, :] < K), other=0.0)
        acc += _load_x(x_ptr, offs, K, GATED, dtype)[None, :] * w.to(tl.float32)
    out = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, out.to(dtype), mask=offs_n < N)


def gemv_config(out_features: int, in_features: int) -> dict[str, int]:
    """Launch config (``BLOCK_N``, ``BLOCK_K``, ``num_warps``, ``num_stages``) for a weight
    ``[N, K]``, from the sweep of ``mm_serve.benchmarks.gemv`` (H200, Qwen2-VL-2B, with PDL):
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
    when None). Raises ``ValueError`` for more
    than one row, mismatched shapes or a strided weight row.
    """
    out_features, in_features = weight.shape
    if x.shape != (1, in_features * (2 if gated else 1)) or weight.stride(-1) != 1:
        raise ValueError(
            f"gemv_triton: x {tuple(x.shape)} (one row) does not fit weight "
            f"{tuple(weight.shape)} (gated={gated}), or the weight's rows are strided."
        )
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(1, out_features, dtype=x.dtype, device=x.device) if out is None else out
    cfg = gemv_config(out_features, in_features) | (config or {})
    _gemv_kernel[(triton.cdiv(out_features, cfg["BLOCK_N"]),)](
        y,
        x,
        weight,
        bias if bias is not None else y,
        out_features,
        in_features,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        GATED=gated,
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        NUM_STAGES=cfg["num_stages"],
        num_warps=cfg["num_warps"],
        **pdl_options(x.device),
    )
    return y
