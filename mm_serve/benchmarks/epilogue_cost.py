"""What does the fused MLP GEMM's activation epilogue cost, and which variant is cheapest?

``kernels/triton_gemm.py`` runs the tower's ``fc1`` + QuickGELU and the LM's ``gate_up`` +
SiLU-and-mul; its epilogue (bias, roundings, an exponential and a division per element) runs
while the tensor cores idle. This script times, per shape, cuBLAS alone and the same persistent
kernel (3 stages, the whole tile stored at once) with these epilogues:

- ``ieee``: the engine's arithmetic, ``1 / (1 + exp(-t))`` (Triton compiles the division to
  ``div.full.f32``, the exponential to ``ex2.approx.f32``);
- ``none``: bias and rounding only, the floor for any epilogue;
- ``rcp``: ``rcp.approx`` instead of the division;
- ``tanh``: ``0.5 tanh(t / 2) + 0.5``, one ``tanh.approx`` per element;
- ``pairs``: ``ieee``'s arithmetic with every rounding to bf16 (``F.linear``'s and the
  activation's) two elements per ``cvt.rn.bf16x2.f32`` (``triton_gemm.round_to``), off the
  conversion unit (XU) that ``ex2`` and ``rcp`` use too. Compiled for sm90 with Triton 3.9
  (``benchmarks/epilogue_sass.py``), the QuickGELU kernel's 384 ``F2F`` become ``F2FP``
  (96 -> 384), leaving 391 ``MUFU`` on that unit against 775, for 2% more instructions;
  SiLU-and-mul's 64 ``F2F`` go likewise;
- ``pairs_ftz``: ``pairs`` with the exponential as ``ex2.approx.ftz.f32`` (the same values
  wherever ``1 + exp(-t)`` can tell them apart), which drops its subnormal handling (the
  QuickGELU kernel: 4,184 instructions against ``pairs``' 4,760);

and the engine's kernel as it is (``engine``: QuickGELU with ``pairs_ftz``'s arithmetic, stored
in two half tiles, with a fourth stage in the shared memory that frees; SiLU-and-mul with
``ieee``'s).

Each line gives the share of outputs that differ from ``ieee`` and the largest difference in
bf16 ulps of the output.

    python -m mm_serve.benchmarks.epilogue_cost
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from mm_serve.kernels.triton_attention_launch import num_sms
from mm_serve.kernels.triton_gemm import (
    CONFIGS,
    QUICK_GELU,
    SILU_AND_MUL,
    exp_ftz,
    linear_act_triton,
    linear_tile,
    round_to,
    tile_offsets,
)

MODES = {"ieee": 0, "none": 1, "rcp": 2, "tanh": 3, "pairs": 4, "pairs_ftz": 5}
STAGES = 3  # with a whole tile's store buffer, the most that fits beside 128 x 256 tiles


@triton.jit
def _exp(x, MODE: tl.constexpr):
    """``tl.exp`` (``ex2.approx.f32`` of ``x log2(e)``), or for ``pairs_ftz`` its ``.ftz``
    form, which flushes subnormal results and arguments to zero (where ``1 + exp`` rounds to
    1 either way) and so skips the subnormal scaling around it."""
    return exp_ftz(x) if MODE == 5 else tl.exp(x)


@triton.jit
def _sigmoid(t, MODE: tl.constexpr):
    if MODE == 0 or MODE >= 4:
        s = 1.0 / (1.0 + _exp(-t, MODE))
    elif MODE == 2:
        e = 1.0 + tl.exp(-t)
        s = tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [e], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        h = tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=f,f", [0.5 * t], dtype=tl.float32, is_pure=True, pack=1
        )
        s = 0.5 * h + 0.5
    return s


@triton.jit
def _kernel(
    x_desc, w_desc, out_desc, bias_ptr, M, N, K,
    ACT: tl.constexpr, MODE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
):  # fmt: skip
    dtype = out_desc.dtype
    num_pid_m, num_pid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=True):
        off_m, off_n = tile_offsets(tile_id, num_pid_m, num_pid_n, GROUP_M, BLOCK_M, BLOCK_N)
        y = linear_tile(
            x_desc, w_desc, bias_ptr, off_m, off_n, N, K, dtype, HAS_BIAS, ACT == 2, BLOCK_M,
            BLOCK_N, BLOCK_K, MODE >= 4,
        )  # fmt: skip
        if ACT == 1:
            if MODE != 1:
                t = round_to(y * 1.702, dtype, MODE >= 4)
                y = y * round_to(_sigmoid(t, MODE), dtype, MODE >= 4)
            out_desc.store([off_m, off_n], y.to(dtype))
        else:
            gate, up = tl.split(tl.permute(tl.reshape(y, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
            if MODE == 0 or MODE >= 4:  # the engine's expression
                gate = round_to(gate / (1.0 + _exp(-gate, MODE)), dtype, MODE >= 4)
            elif MODE != 1:
                gate = (gate * _sigmoid(gate, MODE)).to(dtype).to(tl.float32)
            out_desc.store([off_m, off_n], (gate * up).to(dtype))


def fused(x, w, bias, act: int, mode: int) -> torch.Tensor:
    bm, bn, bk, _, warps = CONFIGS[act]
    m, k = x.shape
    n = w.shape[0] // 2 if act == SILU_AND_MUL else w.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    sms = num_sms(x.device)
    w_desc = (
        TensorDescriptor.from_tensor(w.view(2, n, k), [2, bn, bk])
        if act == SILU_AND_MUL
        else TensorDescriptor.from_tensor(w, [bn, bk])
    )
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    _kernel[(min(sms, tiles),)](
        TensorDescriptor.from_tensor(x, [bm, bk]), w_desc,
        TensorDescriptor.from_tensor(out, [bm, bn]), x if bias is None else bias, m, n, k,
        ACT=act, MODE=mode, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=8, NUM_SMS=sms, num_stages=STAGES, num_warps=warps,
    )  # fmt: skip
    return out


def _us(fn) -> float:
    return triton.testing.do_bench(fn, rep=200, return_mode="median") * 1e3


def main() -> None:
    shapes = {
        "tower fc1 26624": (26624, 1280, 5120, QUICK_GELU, True),
        "LM gate_up 8192": (8192, 1536, 2 * 8960, SILU_AND_MUL, False),
    }
    for name, (m, k, n, act, has_bias) in shapes.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
        flops = 2 * m * k * n
        cublas = _us(lambda: F.linear(x, w, bias))  # noqa: B023
        print(f"{name}: cuBLAS {cublas:.1f} us ({flops / cublas / 1e6:.0f} TFLOP/s)")
        ref = fused(x, w, bias, act, 0).float()
        calls = {
            label: functools.partial(fused, x, w, bias, act, mode) for label, mode in MODES.items()
        }
        calls["engine"] = functools.partial(linear_act_triton, x, w, bias, act)
        for label, call in calls.items():
            out, us = call().float(), _us(call)
            ulp = ((out - ref).abs() / ref.abs().clamp_min(1e-30) * 2**8).max().item()
            share = (out != ref).float().mean().item()
            print(
                f"  {label:6s} {us:8.1f} us ({flops / us / 1e6:.0f} TFLOP/s, "
                f"{us / cublas:.3f}x cuBLAS)  differs in {share:.2%} of outputs, "
                f"at most {ulp:.1f} bf16 ulps"
            )


if __name__ == "__main__":
    main()
