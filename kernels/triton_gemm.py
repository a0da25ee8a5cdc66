"""A GEMM with the MLP's activation in its epilogue: ``act(x @ W.T + b)`` in one kernel (Hopper).

The persistent GEMM applies the activation to each output tile in registers and writes only
the result, saving the write and re-read of the first projection's output (``[T, 2 I]`` gated,
``[N, 4 d]`` the tower's). The weight stays as stored (``[N, K]``):

- ``quick_gelu``: ``x * sigmoid(1.702 x)`` of ``F.linear``'s output, stored in two halves (the
  half-size store buffer leaves shared memory for a fourth stage); bf16x2 conversions and a
  subnormal-flushing exponential give the same outputs;
- ``silu_and_mul``: for ``W = [gate; up]`` (``[2 I, K]``), ``silu(gate) * up``: one TMA load
  (``W`` seen as ``[2, I, K]``) brings the same ``BLOCK_N`` features of gate and up, so a tile
  needs no data from another.

The epilogue rounds as the unfused path (``F.linear``'s bf16/fp16 output, then
``kernels/triton_activation.py``), so only the summation order can differ from cuBLAS. TMA
(``TensorDescriptor``) needs sm90+; ``dispatch_linear`` takes it for steps of at least
``FUSED_MLP_MIN_ROWS`` rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from mm_serve.kernels.triton_attention import num_sms

QUICK_GELU, SILU_AND_MUL = 1, 2
# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps) per activation; SiLU-and-mul's BLOCK_N is per half.
# QuickGELU stores its tile in two halves, which leaves shared memory for a fourth stage.
CONFIGS = {QUICK_GELU: (128, 256, 64, 4, 8), SILU_AND_MUL: (128, 128, 64, 3, 8)}


@triton.jit
def tile_offsets(
    tile_id, num_pid_m, num_pid_n,
    GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The first row and column of output tile ``tile_id``, in grouped order: ``GROUP_M`` row
    blocks share each weight tile while it is in L2."""
    group = GROUP_M * num_pid_n
    first_m = (tile_id // group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m, pid_n = first_m + (tile_id % group) % size_m, (tile_id % group) // size_m
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def round_to(x, dtype: tl.constexpr, PAIRS: tl.constexpr = False):
    """``x.to(dtype).to(tl.float32)`` for float32 ``x``. ``PAIRS`` (bfloat16 on a GPU): two
    elements per ``cvt.rn.bf16x2.f32`` (the same rounding), unpacked by a shift and a mask.
    A scalar ``cvt`` per element runs on the conversion unit (XU) that the epilogues'
    exponentials and reciprocals need too; the packed one runs on the ALU. Inline PTX: not in
    Triton's interpreter."""
    if PAIRS and dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 p; cvt.rn.bf16x2.f32 p, $3, $2; shl.b32 $0, p, 16; "
            "and.b32 $1, p, 0xffff0000; }",
            "=r,=r,r,r",
            [x.to(tl.uint32, bitcast=True)],
            dtype=tl.uint32,
            is_pure=True,
            pack=2,
        ).to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def exp_ftz(x):
    """``tl.exp(x)`` (``ex2.approx.f32`` of ``x log2(e)``) as ``ex2.approx.ftz.f32``: subnormal
    arguments and results go to zero, which skips the scaling around them. Where a sigmoid's
    ``1 + exp(-t)`` can tell the two apart, it rounds to 1 either way. Inline PTX: not in
    Triton's interpreter."""
    return tl.inline_asm_elementwise(
        "ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * 1.4426950408889634], dtype=tl.float32,
        is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def linear_tile(
    x_desc, w_desc, bias_ptr, off_m, off_n, N, K, dtype: tl.constexpr, HAS_BIAS: tl.constexpr,
    PAIRED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ROUND_PAIRS: tl.constexpr = False,
):  # fmt: skip
    """One output tile of ``F.linear(x, w, bias)`` at ``(off_m, off_n)``: ``[BLOCK_M,
    BLOCK_N]``, rounded to ``dtype`` as F.linear's output (``round_to``, ``ROUND_PAIRS``),
    returned in float32 (TMA loads along K). ``PAIRED`` (SiLU-and-mul): ``w_desc`` is ``[2, N,
    K]``; one load brings the gate and up tiles, and the result is ``[BLOCK_M, 2 BLOCK_N]``,
    gate columns then up columns (``bias`` ``[2 N]`` likewise)."""
    ACC_N: tl.constexpr = 2 * BLOCK_N if PAIRED else BLOCK_N
    acc = tl.zeros((BLOCK_M, ACC_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if PAIRED:
            w = tl.reshape(w_desc.load([0, off_n, k]), (ACC_N, BLOCK_K))
        else:
            w = w_desc.load([off_n, k])
        acc = tl.dot(x_desc.load([off_m, k]), w.T, acc)
    if HAS_BIAS:
        within = off_n + tl.arange(0, ACC_N) % BLOCK_N  # the feature in gate's or up's half
        cols = (tl.arange(0, ACC_N) // BLOCK_N) * N + within  # one half unless PAIRED
        acc += tl.load(bias_ptr + cols, mask=within < N, other=0.0).to(tl.float32)[None, :]
    return round_to(acc, dtype, ROUND_PAIRS)


@triton.jit
def _linear_act_kernel(
    x_desc, w_desc, out_desc, bias_ptr, M, N, K,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """``out[M, N] = act(x[M, K] @ w.T + bias)``; for SiLU-and-mul, ``w`` is ``[2 N, K]``
    (gate rows, then up rows) and ``bias`` ``[2 N]``. ``PTX`` (a GPU, not the interpreter):
    QuickGELU's roundings in pairs and its exponential flushing subnormals, the same values
    (``round_to``, ``exp_ftz``)."""
    dtype = out_desc.dtype
    num_pid_m, num_pid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=True):
        off_m, off_n = tile_offsets(tile_id, num_pid_m, num_pid_n, GROUP_M, BLOCK_M, BLOCK_N)
        y = linear_tile(
            x_desc, w_desc, bias_ptr, off_m, off_n, N, K, dtype, HAS_BIAS, ACT == 2, BLOCK_M,
            BLOCK_N, BLOCK_K, PTX and ACT == 1,
        )  # fmt: skip
        if ACT == 1:  # stored in two halves: a half-size store buffer leaves room for a stage
            y0, y1 = tl.split(tl.permute(tl.reshape(y, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            out_desc.store([off_m, off_n], _quick_gelu(y0, dtype, PTX).to(dtype))
            out_desc.store([off_m, off_n + BLOCK_N // 2], _quick_gelu(y1, dtype, PTX).to(dtype))
        else:  # silu_and_mul_triton's roundings, gate and up being the tile's two halves
            gate, up = tl.split(tl.permute(tl.reshape(y, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
            y = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
            out_desc.store([off_m, off_n], y.to(dtype))


@triton.jit
def _quick_gelu(y, dtype: tl.constexpr, PTX: tl.constexpr):
    """quick_gelu_triton's roundings, on ``F.linear``'s output ``y`` (float32 of bf16/fp16)."""
    t = round_to(y * 1.702, dtype, PTX)
    e = exp_ftz(-t) if PTX else tl.exp(-t)
    return y * round_to(1.0 / (1.0 + e), dtype, PTX)


def linear_act_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: int
) -> torch.Tensor:
    """``x [M, K]``, ``weight [N, K]`` (``[2 I, K]`` for ``SILU_AND_MUL``), ``bias [N]`` or
    None -> ``[M, N]`` (``[M, I]``), in ``x``'s dtype; ``x`` and ``weight`` contiguous, of one
    dtype, ``K`` and ``N`` multiples of 8 (TMA's 16-byte strides), as ``dispatch_linear``
    checks."""
    block_m, block_n, block_k, stages, warps = CONFIGS[act]
    m, k = x.shape
    n = weight.shape[0] // 2 if act == SILU_AND_MUL else weight.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    sms = num_sms(x.device)  # a small number on a CPU (Triton's interpreter)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    store_n = block_n // 2 if act == QUICK_GELU else block_n  # QuickGELU stores half tiles
    if act == SILU_AND_MUL:  # [gate; up] as [2, I, K]: one load brings both tiles
        w_desc = TensorDescriptor.from_tensor(weight.view(2, n, k), [2, block_n, block_k])
    else:
        w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    _linear_act_kernel[(min(sms, tiles),)](
        TensorDescriptor.from_tensor(x, [block_m, block_k]),
        w_desc,
        TensorDescriptor.from_tensor(out, [block_m, store_n]),
        x if bias is None else bias,
        m, n, k, ACT=act, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP_M=8, NUM_SMS=sms, PTX=x.is_cuda, num_stages=stages,
        num_warps=warps,
    )  # fmt: skip
    return out
