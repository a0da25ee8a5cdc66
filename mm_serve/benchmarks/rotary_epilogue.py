"""Could the vision tower's 2-D rotary ride in its qkv GEMM, with q and k in interleaved pairs?

The tower's rotary pass reads q and k after the qkv GEMM and writes them back (about 33 ms of
workload 1's batch on an H100). Folding it into the GEMM's epilogue failed in the seventeenth
session because a rotary pair ``(d, d + head_dim / 2)`` lies 40 columns apart, in other threads
of the MMA layout (BENCHMARKS.md). Attention scores are sums over the head dim, so any
permutation of the head dim applied to both q and k leaves them unchanged. Here the rows of
the q and k weights (and biases) are permuted so that each head stores its pairs side by side:
column ``2 i`` holds dim ``i``, column ``2 i + 1`` dim ``i + head_dim / 2``. A pair then sits
in one thread's two adjacent accumulator columns, and the epilogue rotates it in registers:
``(x1 cos - x2 sin, x2 cos + x1 sin)`` in float32 from the bf16-rounded GEMM output, as
``apply_vision_rotary_ref`` computes (FP fusion off: no FMA skips a rounding). v is untouched.

The script times, per patch count, cuBLAS's qkv plus the engine's rotary kernel against the
fused GEMM over the permuted weight, and checks that the fused q and k, un-permuted, match the
engine's (relative error at most 1e-2, bf16).

    python -m mm_serve.benchmarks.rotary_epilogue [--patches 16384 26624]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from mm_serve.kernels.triton_gemm import _tile

# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps). (128, 256, 64, 3, 8) asks for 240 KiB of shared
# memory on an H200 (the epilogue's pair shuffle goes through it): over the 227 KiB an SM has.
CONFIGS = [(128, 256, 64, 2, 8), (128, 128, 64, 4, 8), (128, 128, 64, 3, 4)]


@triton.jit
def _qkv_rotary_kernel(
    x_desc, w_desc, out_desc, bias_ptr, table_ptr, M, N, K, ROT_N,
    HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
):  # fmt: skip
    """``out[M, N] = x @ w.T + bias``, its first ``ROT_N`` columns (q and k, pairs side by side)
    rotated by ``table [M, 2 HALF]`` (float32: the cos, then the sin of each pair's angle)."""
    dtype = out_desc.dtype
    num_pid_m, num_pid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            acc = tl.dot(x_desc.load([off_m, k]), w_desc.load([off_n, k]).T, acc)
        cols = off_n + tl.arange(0, BLOCK_N)
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        y = acc.to(dtype).to(tl.float32)  # F.linear's output
        # ROT_N is a multiple of BLOCK_N: a tile is all q or k (rotated) or all v (kept). No
        # branch: Triton cannot flatten a loop holding one; v's tiles load no table entries.
        rotate = off_n < ROT_N
        x1, x2 = tl.split(tl.reshape(y, (BLOCK_M, BLOCK_N // 2, 2)))
        rows = off_m + tl.arange(0, BLOCK_M)[:, None]
        pair = (off_n // 2 + tl.arange(0, BLOCK_N // 2)[None, :]) % HALF
        angles = table_ptr + rows.to(tl.int64) * (2 * HALF) + pair
        load = rows < tl.where(rotate, M, 0)
        cos = tl.load(angles, mask=load, other=0.0)  # v, rows past M: unused
        sin = tl.load(angles + HALF, mask=load, other=0.0)
        rotated = tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin)
        y = tl.where(rotate, tl.reshape(rotated, (BLOCK_M, BLOCK_N)), y)
        out_desc.store([off_m, off_n], y.to(dtype))


def pair_order(num_heads: int, head_dim: int) -> torch.Tensor:
    """``[num_heads * head_dim]`` long: new feature ``h * head_dim + 2 i + s`` is old feature
    ``h * head_dim + i + s * head_dim / 2`` (``s`` in 0, 1)."""
    half = head_dim // 2
    i = torch.arange(half).repeat_interleave(2)
    s = torch.arange(2).repeat(half)
    within = i + s * half
    return (torch.arange(num_heads)[:, None] * head_dim + within[None, :]).flatten()


def permute_qkv(weight, bias, num_heads: int, head_dim: int):
    """The qkv weight ``[3 D, K]`` and bias ``[3 D]`` with q's and k's rows in pair order."""
    dim = num_heads * head_dim
    order = pair_order(num_heads, head_dim).to(weight.device)
    rows = torch.cat([order, dim + order, torch.arange(2 * dim, 3 * dim, device=weight.device)])
    return weight[rows].contiguous(), bias[rows].contiguous()


def qkv_rotary(x, weight, bias, table, num_heads: int, config=None) -> torch.Tensor:
    """``x [M, K]``, the permuted ``weight [3 D, K]`` and ``bias [3 D]``, ``table [M, head_dim]``
    float32 -> ``[M, 3 D]``: q and k rotated, in pair order; v as ``F.linear`` gives it."""
    block_m, block_n, block_k, stages, warps = config or CONFIGS[0]
    m, k = x.shape
    n = weight.shape[0]
    rot_n = 2 * n // 3
    if rot_n % block_n:
        raise ValueError(f"q and k ({rot_n} columns) must be whole tiles of {block_n}.")
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    _qkv_rotary_kernel[(min(num_sms, tiles),)](
        TensorDescriptor.from_tensor(x, [block_m, block_k]),
        TensorDescriptor.from_tensor(weight, [block_n, block_k]),
        TensorDescriptor.from_tensor(out, [block_m, block_n]),
        bias, table, m, n, k, rot_n, HALF=table.shape[1] // 2, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, NUM_SMS=num_sms, num_stages=stages,
        num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return out


def engine_path(x, weight, bias, rotary, num_heads: int):
    """The engine's tower today: cuBLAS's qkv, then the rotary kernel -> (q, k, v)."""
    from mm_serve.kernels.dispatch import apply_vision_rotary

    q, k, v = F.linear(x, weight, bias).view(x.shape[0], 3, num_heads, -1).unbind(1)
    q, k = apply_vision_rotary(q, k, rotary)
    return q, k, v


def unpermute(out, num_heads: int, head_dim: int):
    """The fused output ``[M, 3 D]`` -> (q, k, v) ``[M, heads, head_dim]`` in natural order."""
    m = out.shape[0]
    q, k, v = out.view(m, 3, num_heads, head_dim).unbind(1)
    inverse = torch.argsort(pair_order(1, head_dim)).to(out.device)
    return q[..., inverse], k[..., inverse], v


def case(patches: int, dim: int = 1280, num_heads: int = 16, device="cuda", dtype=torch.bfloat16):
    """Random inputs of one tower block: ``x``, the qkv weight and bias, rotary tables."""
    from mm_serve.encoders.qwen2_vl import rotary_cos_sin
    from mm_serve.kernels.rotary import vision_rotary

    head_dim = dim // num_heads
    side = int(patches**0.5) // 2 * 2
    grids = [[1, side, patches // side // 2 * 2]]
    cos, sin = rotary_cos_sin(grids, 2, head_dim, 10000.0, torch.device(device))
    m = cos.shape[0]
    x = torch.randn(m, dim, device=device, dtype=dtype)
    weight = torch.randn(3 * dim, dim, device=device, dtype=dtype) / dim**0.5
    bias = torch.randn(3 * dim, device=device, dtype=dtype)
    return x, weight, bias, vision_rotary(cos, sin)


def max_error(x, weight, bias, rotary, num_heads: int, config=None) -> float:
    """The fused path's largest relative difference from the engine's, over q, k and v."""
    head_dim = rotary.table.shape[1]
    w_perm, b_perm = permute_qkv(weight, bias, num_heads, head_dim)
    out = qkv_rotary(x, w_perm, b_perm, rotary.table, num_heads, config)
    ours, theirs = (
        unpermute(out, num_heads, head_dim),
        engine_path(x, weight, bias, rotary, num_heads),
    )
    pairs = zip(ours, theirs, strict=True)
    return max(
        ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in pairs
    )


def rows(patches: int, num_heads: int = 16) -> list[str]:
    """One patch count: both paths' median us, and per config the fused path's error."""
    x, weight, bias, rotary = case(patches)
    w_perm, b_perm = permute_qkv(weight, bias, num_heads, rotary.table.shape[1])
    base = triton.testing.do_bench(lambda: engine_path(x, weight, bias, rotary, num_heads))
    lines = [f"{x.shape[0]:>6} patches: cuBLAS + rotary {base * 1e3:7.1f} us"]
    for config in CONFIGS:
        err = max_error(x, weight, bias, rotary, num_heads, config)
        ours = triton.testing.do_bench(
            lambda c=config: qkv_rotary(x, w_perm, b_perm, rotary.table, num_heads, c)
        )
        lines.append(
            f"  fused {config}: {ours * 1e3:7.1f} us ({ours / base:.3f}x), max rel diff {err:.1e}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patches", type=int, nargs="+", default=[16384, 26624])
    for patches in parser.parse_args().patches:
        print("\n".join(rows(patches)), flush=True)


if __name__ == "__main__":
    main()
