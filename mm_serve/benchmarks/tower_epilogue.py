"""Could the vision tower's QuickGELU ride in its fc1 GEMM? A Triton GEMM with the bias and the
activation in its epilogue, against cuBLAS followed by the engine's one-pass QuickGELU.

    python -m mm_serve.benchmarks.tower_epilogue [--images 26]

The shapes are Qwen2-VL's tower at one encode step of workload 1 (``--images`` 448x448 images,
1,024 patches each): fc1 (1280 -> 5120, with the activation), fc2 (5120 -> 1280) and qkv
(1280 -> 3840). The Triton kernel is the persistent, TMA-fed form of Triton's tutorial 09
(a fixed grid of one program per multiprocessor walking the output tiles in grouped order).
Each fused output is checked against the unfused one (relative error below 1e-2) before it is
timed (``triton.testing.do_bench``, median). A measurement, not an engine kernel: the engine
keeps cuBLAS wherever this script finds it faster.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

from mm_serve.kernels.triton_activation import quick_gelu_triton

# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps): the configurations that fit an H100's
# shared memory among those tried.
CONFIGS = ((128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 4))


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, QUICK_GELU: tl.constexpr,
):  # fmt: skip
    """``out = act(x @ w.T + b)`` for ``x [M, K]``, ``w [N, K]``, ``b [N]`` (contiguous), with
    the reference's roundings: the GEMM's result rounded to the output dtype, then each of
    QuickGELU's three ops rounded (``quick_gelu_ref``)."""
    dtype = out_ptr.dtype.element_ty
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    o_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=True):
        first_m = tile // per_group * GROUP_M
        group_m = min(num_m - first_m, GROUP_M)
        row0 = (first_m + tile % per_group % group_m) * BM
        col0 = tile % per_group // group_m * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            acc = tl.dot(x_desc.load([row0, k]), w_desc.load([col0, k]).T, acc)
        cols = col0 + tl.arange(0, BN)
        bias = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = (acc + bias[None, :]).to(dtype)
        if QUICK_GELU:
            yf = y.to(tl.float32)
            t = (yf * 1.702).to(dtype).to(tl.float32)
            s = (1.0 / (1.0 + tl.exp(-t))).to(dtype).to(tl.float32)
            y = (yf * s).to(dtype)
        o_desc.store([row0, col0], y)


def triton_linear(x, weight, bias, quick_gelu: bool, config) -> torch.Tensor:
    """``_linear_kernel`` on ``x [M, K]``, ``weight [N, K]``, ``bias [N]`` -> ``[M, N]``."""
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk, stages, warps = config
    programs = torch.cuda.get_device_properties(x.device).multi_processor_count
    _linear_kernel[(programs,)](
        x, weight, bias, out, m, n, k, BM=bm, BN=bn, BK=bk, GROUP_M=8,
        NUM_PROGRAMS=programs, QUICK_GELU=quick_gelu, num_stages=stages, num_warps=warps,
    )  # fmt: skip
    return out


def case_rows(name: str, m: int, k: int, n: int, quick_gelu: bool) -> list[dict]:
    """cuBLAS (+ the Triton QuickGELU) and each Triton config: microseconds and TFLOP/s."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)

    def unfused():
        y = F.linear(x, weight, bias)
        return quick_gelu_triton(y) if quick_gelu else y

    reference = unfused()
    methods = {"cuBLAS" + (" + QuickGELU" if quick_gelu else ""): unfused}
    for config in CONFIGS:
        methods[f"Triton {config}"] = lambda c=config: triton_linear(x, weight, bias, quick_gelu, c)
    rows = []
    for method, fn in methods.items():
        out = fn()
        error = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
        if not error < 1e-2:
            raise AssertionError(f"{name} {method}: relative error {error}")
        us = 1e3 * do_bench(fn, warmup=50, rep=300, return_mode="median")
        rows.append({"case": name, "method": method, "us": us, "tflops": 2 * m * n * k / us / 1e6})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=26, help="448x448 images in the step.")
    args = parser.parse_args()
    triton.set_allocator(
        lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda")
    )
    m = args.images * 1024
    cases = (("fc1 + QuickGELU", 1280, 5120, True), ("fc2", 5120, 1280, False),
             ("qkv", 1280, 3840, False))  # fmt: skip
    print(
        f"{torch.cuda.get_device_name()}: the tower's GEMMs at {m} patches ({args.images} images)"
    )
    print(f"{'case':16} {'method':34} {'us':>8} {'TFLOP/s':>8}")
    for name, k, n, quick_gelu in cases:
        for r in case_rows(name, m, k, n, quick_gelu):
            print(f"{r['case']:16} {r['method']:34} {r['us']:8.0f} {r['tflops']:8.0f}")


if __name__ == "__main__":
    main()
