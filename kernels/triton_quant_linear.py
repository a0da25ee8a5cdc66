"""Triton kernels for linear layers on quantized weights (layout: ``models.layers.quantization``;
float32 references: ``quant_linear``).

- ``quantize_fp8_triton``: activations to float8_e4m3fn per token, or per token and group of
  ``GROUP`` features, ``scale = max|x| / 448`` (``quantize_fp8_rows``).
- ``fp8_linear_triton``: ``x_q @ W_q.T`` with float32 scales per token (group) of ``x_q`` and
  per output row (and group) of ``W_q``; with groups (128 x 128 weight blocks, DeepSeek-V3's
  recipe) each K tile's product is scaled as it is accumulated. Needs FP8 tensor cores (sm_89+);
  where cuBLASLt has the recipe (``dispatch_quant``) it serves instead.
- ``int4_linear_triton``: W4A16, the int4 weight dequantized in the GEMM's inner loop,
  ``w = (q - z) * s`` per row and group. Its weight is ``pack_int4``'s layout: two values to a
  byte, a group's first half in the low nibbles and its second half in the high nibbles
  (``quant_linear.pack_int4``), so one tile of bytes gives two dense operand tiles without
  shuffling. Small batches split K
  across programs (partial sums added in float32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mm_serve.kernels.quant_linear import FP8_DTYPE, FP8_MAX

_MIN_SCALE = torch.finfo(torch.float32).eps


@triton.jit
def _quantize_fp8_kernel(
    x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, min_scale,
    GROUP: tl.constexpr, FP8_MAX_C: tl.constexpr,
):  # fmt: skip
    """Program (row, group): ``GROUP`` features of one row to FP8 and their scale (scales
    stored group-major: ``scale[group * M + row]``)."""
    row, group = tl.program_id(0), tl.program_id(1)
    offs = group * GROUP + tl.arange(0, GROUP)
    ok = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0) / FP8_MAX_C, min_scale)
    q = tl.clamp(x / scale, -FP8_MAX_C, FP8_MAX_C)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + group * tl.num_programs(0) + row, scale)


def quantize_fp8_triton(
    x: torch.Tensor,  # [M, K]
    group_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q [M, K] float8_e4m3fn, scale [M, G] float32)``, G = 1 (per token) or
    ``K / group_size``; as ``quantize_fp8_rows``. ``scale`` is M-major (strides ``(1, M)``),
    the layout cuBLASLt's block-scaled GEMM reads."""
    rows, cols = x.shape
    group = group_size or triton.next_power_of_2(cols)
    groups = triton.cdiv(cols, group)
    x_q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((groups, rows), dtype=torch.float32, device=x.device).t()
    if rows:
        _quantize_fp8_kernel[(rows, groups)](
            x, x_q, scale, cols, x.stride(0), x_q.stride(0), _MIN_SCALE,
            GROUP=group, FP8_MAX_C=FP8_MAX, num_warps=4 if group <= 1024 else 8,
        )  # fmt: skip
    return x_q, scale


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Row and column tile of this program, ``GROUP_M`` row tiles walked together (L2 reuse)."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * tiles_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % width) % rows, (pid % width) // rows


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, M, N, K,
    stride_am, stride_bn, stride_cm, stride_as, stride_as_k, stride_bs,
    BLOCK_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """``C = (A * a_scale) @ (B * b_scale).T + bias``; A ``[M, K]``, B ``[N, K]`` FP8. With
    ``BLOCK_SCALES`` the scales are per ``BLOCK_K`` features (column ``k // BLOCK_K``), else
    one per row, applied once at the end."""
    tile_m, tile_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
    b_rows = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & (k[None, :] < K), other=0.0)
        b = tl.load(b_rows + k[:, None], mask=n_ok[None, :] & (k[:, None] < K), other=0.0)
        if BLOCK_SCALES:
            a_s = tl.load(a_scale_ptr + offs_m * stride_as + kb * stride_as_k, mask=m_ok, other=0.0)
            b_s = tl.load(b_scale_ptr + offs_n * stride_bs + kb, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc = tl.dot(a, b, acc)
    if not BLOCK_SCALES:
        a_s = tl.load(a_scale_ptr + offs_m * stride_as, mask=m_ok, other=0.0)
        b_s = tl.load(b_scale_ptr + offs_n * stride_bs, mask=n_ok, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_gemm_config(rows: int) -> dict[str, int]:
    """Tiles for ``rows`` tokens: ``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``."""
    if rows <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 64 if rows <= 256 else 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}


def fp8_linear_triton(
    x_q: torch.Tensor,  # [M, K] float8_e4m3fn
    x_scale: torch.Tensor,  # [M, G] float32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N, G] float32
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """``[M, N]`` in ``out_dtype``: G = 1 (per-token x per-channel scales) or ``K / 128``
    (blocks of 128 features). ``config`` overrides ``fp8_gemm_config`` (benchmarks)."""
    rows, cols = x_q.shape
    out_features = weight.shape[0]
    out = torch.empty((rows, out_features), dtype=out_dtype, device=x_q.device)
    cfg = {**fp8_gemm_config(rows), **(config or {})}
    block_scales = weight_scale.shape[1] > 1
    block_k = cols // weight_scale.shape[1] if block_scales else 128
    grid = (triton.cdiv(rows, cfg["BLOCK_M"]) * triton.cdiv(out_features, cfg["BLOCK_N"]),)
    _fp8_gemm_kernel[grid](
        x_q, weight, out, x_scale, weight_scale, bias if bias is not None else out,
        rows, out_features, cols, x_q.stride(0), weight.stride(0), out.stride(0),
        *x_scale.stride(), weight_scale.stride(0),
        BLOCK_SCALES=block_scales, HAS_BIAS=bias is not None,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, GROUP_M=8,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


@triton.jit
def _fp8_gemv_kernel(
    y_ptr, x_ptr, w_ptr, w_scale_ptr, bias_ptr, N, K, stride_wn,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """One token, W8A16: ``y = x @ (W * w_scale).T + bias`` with one scale per row; each
    program ``BLOCK_N`` rows of the FP8 weight streamed in ``BLOCK_K`` tiles, products
    accumulated elementwise, the scale applied once."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + offs_k
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k[None, :] < K), other=0.0)
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1) * tl.load(w_scale_ptr + offs_n, mask=n_ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


GEMV_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4, "num_stages": 4}


def fp8_gemv_triton(
    x: torch.Tensor,  # [1, K] fp16/bf16
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N, 1] float32
    bias: torch.Tensor | None,  # [N]
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """``[1, N]`` in ``x.dtype``: the W8A16 linear for one token."""
    cols, out_features = x.shape[1], weight.shape[0]
    out = torch.empty((1, out_features), dtype=x.dtype, device=x.device)
    cfg = {**GEMV_CONFIG, **(config or {})}
    _fp8_gemv_kernel[(triton.cdiv(out_features, cfg["BLOCK_N"]),)](
        out, x, weight, weight_scale, bias if bias is not None else out, out_features, cols,
        weight.stride(0), HAS_BIAS=bias is not None, BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], NUM_STAGES=cfg["num_stages"], num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out


@triton.jit
def _nibbles_minus_8(n):
    """``n - 8`` in float32 for integers ``n`` in 0..15 without an int-to-float conversion
    (issued at a fraction of the float rate): ``n`` in the low mantissa bits of ``2**23``,
    then ``2**23 + 8`` subtracted (the trick of LOP3-based dequantization, e.g. Marlin's)."""
    return (n.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def _int4_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_om, stride_os, groups_per_split,
    HAS_ZERO: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Partial ``x @ W.T`` over the K groups of split ``program_id(1)``, float32 into
    ``out[split]`` (or in the output's dtype when there is one split). One K tile is one
    group: ``GROUP / 2`` bytes per weight row give its low and high halves."""
    tile_m, tile_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    HALF: tl.constexpr = GROUP // 2
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    num_groups = K // GROUP
    first = split * groups_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(first, tl.minimum(first + groups_per_split, num_groups)):
        packed = tl.load(w_rows + g * HALF + offs_h[:, None], mask=n_ok[None, :], other=0)
        s = tl.load(scale_ptr + offs_n * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
        zero = tl.zeros([BLOCK_N], tl.float32)
        if HAS_ZERO:
            zero += tl.load(zero_ptr + offs_n * stride_sn + g, mask=n_ok, other=0).to(tl.float32)
        x_lo = tl.load(x_rows + g * GROUP + offs_h[None, :], mask=m_ok[:, None], other=0.0)
        x_hi = tl.load(x_rows + g * GROUP + HALF + offs_h[None, :], mask=m_ok[:, None], other=0.0)
        w_lo = ((_nibbles_minus_8(packed & 0xF) - zero) * s).to(x_lo.dtype)  # [HALF, BLOCK_N]
        w_hi = ((_nibbles_minus_8(packed >> 4) - zero) * s).to(x_lo.dtype)
        acc = tl.dot(x_lo, w_lo, acc)
        acc = tl.dot(x_hi, w_hi, acc)
    out = out_ptr + split * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def int4_gemm_config(rows: int, out_features: int, num_groups: int, device) -> dict[str, int]:
    """Tiles (``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``) and ``SPLITS``: small
    batches split K until about two programs per SM run (each split at least four groups)."""
    from mm_serve.kernels.triton_attention import num_sms

    cfg = {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
    if rows > 64:
        cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4}
    elif rows > 16:
        cfg["BLOCK_M"] = 64
    tiles = triton.cdiv(rows, cfg["BLOCK_M"]) * triton.cdiv(out_features, cfg["BLOCK_N"])
    cfg["SPLITS"] = max(1, min(2 * num_sms(device) // tiles, num_groups // 4))
    return cfg


INT4_GEMV_CONFIG = {"BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 4, "num_stages": 4}


@triton.jit
def _int4_gemv_kernel(
    y_ptr, x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, N, K, stride_wn, stride_sn,
    HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """One token: ``y = x @ W.T + bias``, W int4 in ``pack_int4``'s layout; each program
    ``BLOCK_N`` rows streamed ``BLOCK_K`` features (whole groups) at a time."""
    HALF: tl.constexpr = GROUP // 2
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_b = tl.arange(0, BLOCK_K // 2)  # the tile's bytes
    k_lo = (offs_b // HALF) * GROUP + offs_b % HALF  # each byte's low-nibble feature
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    s_rows = offs_n[:, None] * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        b_ok = k0 // 2 + offs_b < K // 2
        ok = n_ok[:, None] & b_ok[None, :]
        packed = tl.load(w_rows + k0 // 2 + offs_b[None, :], mask=ok, other=0)
        g = s_rows + (k0 // GROUP + offs_b // HALF)[None, :]
        s = tl.load(scale_ptr + g, mask=ok, other=0.0).to(tl.float32)
        x_lo = tl.load(x_ptr + k0 + k_lo, mask=b_ok, other=0.0).to(tl.float32)
        x_hi = tl.load(x_ptr + k0 + k_lo + HALF, mask=b_ok, other=0.0).to(tl.float32)
        lo = _nibbles_minus_8(packed & 0xF)  # stored plus 8
        hi = _nibbles_minus_8(packed >> 4)
        if HAS_ZERO:
            zero = tl.load(zero_ptr + g, mask=ok, other=0).to(tl.float32)
            lo -= zero
            hi -= zero
        acc += (lo * x_lo[None, :] + hi * x_hi[None, :]) * s
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def int4_gemv_triton(
    x: torch.Tensor,  # [1, K] fp16/bf16
    weight: torch.Tensor,  # [N, K / 2] uint8, pack_int4's layout
    scale: torch.Tensor,  # [N, K / group_size]
    zero_point: torch.Tensor | None,  # [N, K / group_size] int8, or None
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """``[1, N]`` in ``x.dtype``: the W4A16 linear for one token."""
    cols, out_features = x.shape[1], weight.shape[0]
    out = torch.empty((1, out_features), dtype=x.dtype, device=x.device)
    cfg = {**INT4_GEMV_CONFIG, **(config or {})}
    _int4_gemv_kernel[(triton.cdiv(out_features, cfg["BLOCK_N"]),)](
        out, x, weight, scale, zero_point if zero_point is not None else scale,
        bias if bias is not None else out, out_features, cols, weight.stride(0), scale.stride(0),
        HAS_ZERO=zero_point is not None, HAS_BIAS=bias is not None, GROUP=group_size,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=max(cfg["BLOCK_K"], group_size),
        NUM_STAGES=cfg["num_stages"], num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out


def int4_linear_triton(
    x: torch.Tensor,  # [M, K] fp16/bf16
    weight: torch.Tensor,  # [N, K / 2] uint8, pack_int4's layout
    scale: torch.Tensor,  # [N, K / group_size]
    zero_point: torch.Tensor | None,  # [N, K / group_size] int8, or None (symmetric)
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """``x @ dequantize_int4(weight, ...).T + bias``, ``[M, N]`` in ``x.dtype`` (as
    ``int4_linear_ref`` on ``pack_int4``'s weight). ``config`` overrides
    ``int4_gemm_config`` (benchmarks)."""
    rows, cols = x.shape
    out_features = weight.shape[0]
    cfg = int4_gemm_config(rows, out_features, cols // group_size, x.device) | (config or {})
    block_m, block_n, splits = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["SPLITS"]
    dtype = x.dtype if splits == 1 else torch.float32
    out = torch.empty((splits, rows, out_features), dtype=dtype, device=x.device)
    per_split = triton.cdiv(cols // group_size, splits)
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(out_features, block_n), splits)
    _int4_gemm_kernel[grid](
        x, weight, scale, zero_point if zero_point is not None else scale, out,
        rows, out_features, cols, x.stride(0), weight.stride(0), scale.stride(0),
        out.stride(1), out.stride(0), per_split,
        HAS_ZERO=zero_point is not None, GROUP=group_size,
        BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=8,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    y = out[0] if splits == 1 else out.sum(0)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
