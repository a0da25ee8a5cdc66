"""Can a split-K Triton GEMM beat cuBLAS on the decode step's small-N GEMMs?

At a decode batch of 256 rows on an H100 (``decode_gemms``), cuBLAS runs Qwen2-VL-2B's ``down``
(1536 x 8960) in 20.4 us against a 9.2 us copy floor, and ``qkv`` and ``o`` in about 6 us
against 2: their output has few tiles (24 of 128 x 128 for ``down``), so few SMs work, or the
call is mostly its fixed latency. Over workload 1's 128 decode steps those three take about
80 ms more than their floors. Here each output tile's ``K`` is cut into ``SPLIT_K`` slices,
one program each (``tiles x SPLIT_K`` programs); each writes its float32 partial sum to a
workspace, and the last program of a tile to arrive (an atomic count per tile) adds the
partials in slice order (so the result does not depend on the arrival order), adds the bias,
rounds once and stores the tile, then resets the count for the next call (a CUDA graph
replays it as is). This is "serial split-K" (CUTLASS's ``GemmSplitKParallel`` with the
reduction in the GEMM's last program).

The script times, per GEMM and batch, cuBLAS and every ``CONFIGS`` entry in one CUDA graph of
``--layers`` calls on their own weights (``decode_gemms.graph_us``: L2 cold, as in the decode
graph), and checks each result against ``F.linear``.

    python -m mm_serve.benchmarks.decode_splitk --model-arch qwen2-vl-2b --batch-sizes 256
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from mm_serve.benchmarks.decode_gemms import gemm_parser, graph_us
from mm_serve.benchmarks.gemm_kernels import model_gemms
from mm_serve.benchmarks.roofline import copy_rate

# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, stages, warps)
CONFIGS = [(128, 128, 64, 4, 4, 4), (128, 128, 64, 2, 4, 4), (64, 128, 64, 4, 4, 4),
           (128, 64, 64, 4, 4, 4), (64, 64, 64, 2, 4, 4), (128, 64, 128, 2, 3, 4),
           (128, 128, 64, 8, 4, 4), (256, 128, 64, 8, 3, 8)]  # fmt: skip


@triton.jit
def _splitk_kernel(
    x_desc, w_desc, out_ptr, bias_ptr, partial_ptr, count_ptr, M, N, stride_out,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, K_ITERS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``out[M, N] = x[M, K] @ w[N, K].T + bias``: program ``(tile, split)`` sums ``K_ITERS``
    blocks of ``K`` into ``partial[tile, split]``; the tile's last program reduces them."""
    tile, split = tl.program_id(0), tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    off_m, off_n = (tile // num_pid_n) * BLOCK_M, (tile % num_pid_n) * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(K_ITERS):  # past K, TMA loads zeros
        k = (split * K_ITERS + i) * BLOCK_K
        acc = tl.dot(x_desc.load([off_m, k]), w_desc.load([off_n, k]).T, acc)
    local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    partials = partial_ptr + tile.to(tl.int64) * SPLIT_K * BLOCK_M * BLOCK_N + local
    tl.store(partials + split * BLOCK_M * BLOCK_N, acc)
    tl.debug_barrier()  # the whole tile written before the count says so
    if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(SPLIT_K):  # slice order, whatever the arrival order
            total += tl.load(partials + s * BLOCK_M * BLOCK_N, cache_modifier=".cg")
        rows = off_m + tl.arange(0, BLOCK_M)[:, None]
        cols = off_n + tl.arange(0, BLOCK_N)[None, :]
        if HAS_BIAS:
            total += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        dst = out_ptr + rows.to(tl.int64) * stride_out + cols
        tl.store(dst, total.to(out_ptr.dtype.element_ty), mask=(rows < M) & (cols < N))
        tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next call


class SplitKLinear:
    """``F.linear`` through ``_splitk_kernel`` with one config, for ``x [M, K]`` and ``weight
    [N, K]`` of one shape (contiguous, fp16/bf16, ``K`` a multiple of 8): owns the float32
    workspace and the per-tile counts (zeros; the kernel leaves them zero)."""

    def __init__(self, m: int, n: int, k: int, config: tuple, device) -> None:
        self.block_m, self.block_n, self.block_k, self.split_k, self.stages, self.warps = config
        self.tiles = triton.cdiv(m, self.block_m) * triton.cdiv(n, self.block_n)
        self.k_iters = triton.cdiv(triton.cdiv(k, self.block_k), self.split_k)
        size = self.tiles * self.split_k * self.block_m * self.block_n
        self.partials = torch.empty(size, device=device, dtype=torch.float32)
        self.counts = torch.zeros(self.tiles, device=device, dtype=torch.int32)

    def __call__(self, x, weight, bias=None) -> torch.Tensor:
        out = torch.empty(x.shape[0], weight.shape[0], device=x.device, dtype=x.dtype)
        _splitk_kernel[(self.tiles, self.split_k)](
            TensorDescriptor.from_tensor(x, [self.block_m, self.block_k]),
            TensorDescriptor.from_tensor(weight, [self.block_n, self.block_k]),
            out, x if bias is None else bias, self.partials, self.counts,
            x.shape[0], weight.shape[0], out.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=self.split_k, K_ITERS=self.k_iters,
            BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k,
            num_stages=self.stages, num_warps=self.warps,
        )  # fmt: skip
        return out


def rows(arch: str, batch_sizes: list[int], layers: int) -> list[tuple]:
    """``(gemm, M, config, cuBLAS us, split-K us, copy floor us, max relative difference)``
    per GEMM, batch and config, printed as made (a config Triton cannot build is skipped)."""
    bps, out = copy_rate("cuda"), []
    for label, (k, n, has_bias) in model_gemms(arch).items():
        if label == "lm_head" or n >= 4 * k:  # gate_up and the LM head have tiles enough
            continue
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
        for m in batch_sizes:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            args = [(x, w, bias) for w in weights]
            cublas, ref = graph_us(F.linear, args), F.linear(x, weights[0], bias).float()
            for config in CONFIGS:
                try:
                    call = SplitKLinear(m, n, k, config, "cuda")
                    diff = (call(x, weights[0], bias).float() - ref).abs().max() / ref.abs().max()
                    us = graph_us(call, args)
                except Exception as e:  # shared memory, or a config this Triton cannot build
                    print(label, m, config, type(e).__name__, flush=True)
                    continue
                out.append((label, m, config, cublas, us, 2 * n * k / bps * 1e6, diff.item()))
                print(*out[-1], flush=True)
    return out


def main() -> None:
    args = gemm_parser(__doc__).parse_args()
    table = rows(args.model_arch, args.batch_sizes, args.layers)
    print("| GEMM | M | BM, BN, BK, split, stages, warps | cuBLAS us | split-K us | copy floor |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for label, m, config, cublas, us, floor, _ in table:
        print(f"| {label} | {m} | {config} | {cublas:.2f} | {us:.2f} | {floor:.2f} |")


if __name__ == "__main__":
    main()
