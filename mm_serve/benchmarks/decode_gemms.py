"""The decode step's GEMMs at batch ``M``: cuBLAS against cuBLASLt, cuBLAS on the weight stored
transposed (``[K, N]``, another layout to its heuristics) and the kernels Inductor's max-autotune
picks.

For each GEMM of the LM (``gemm_kernels.model_gemms``: the model on ``meta``), one CUDA graph of
``--layers`` calls, each on its own weight (as the decode graph runs them: no weight reused from
L2), is replayed; the table gives microseconds per call and the matmul-rate and copy-rate floors
of one call. cuBLASLt is torch's other BLAS back end (``preferred_blas_library("cublaslt")``,
or ``TORCH_BLAS_PREFER_CUBLASLT=1`` for a whole process). Inductor's choice is
``torch.compile(F.linear, mode="max-autotune-no-cudagraphs")`` over the same shapes (its
autotune log names the kernel).

    python -m mm_serve.benchmarks.decode_gemms --model-arch qwen2-vl-2b --batch-sizes 128 256 \
        [--no-inductor]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from mm_serve.benchmarks.architectures import ARCHITECTURES
from mm_serve.benchmarks.gemm_kernels import model_gemms
from mm_serve.benchmarks.roofline import measure_rates


def graph_us(call, args_per_layer: list[tuple], repeats: int = 50) -> float:
    """Median microseconds per call of ``call(*args)`` over the layers, in one CUDA graph."""
    for args in args_per_layer[:2]:
        call(*args)  # compile / autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in args_per_layer:
            call(*args)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(args_per_layer))
    return statistics.median(times)


def cublaslt_us(args_per_layer: list[tuple]) -> float:
    """``graph_us`` of ``F.linear`` with cuBLASLt as torch's BLAS back end."""
    default = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return graph_us(F.linear, args_per_layer)
    finally:
        torch.backends.cuda.preferred_blas_library(default)


def transposed_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None):
    """``F.linear(x, weight_t.T, bias)`` for a weight stored ``[K, N]``."""
    return x @ weight_t if bias is None else torch.addmm(bias, x, weight_t)


def rows(arch: str, batch_sizes: list[int], layers: int, inductor: bool = True) -> list[tuple]:
    """``(gemm, M, cuBLAS us, cuBLASLt us, cuBLAS on [K, N] us, Inductor us or nan, matmul
    floor us, copy floor us)`` per shape and M."""
    rates = measure_rates("cuda")
    # One compiled F.linear per shape and M: past Dynamo's default limit of 8 it runs eagerly.
    torch._dynamo.config.recompile_limit = 64
    flops, bps = rates.matmul_flops_per_s, rates.copy_bytes_per_s
    compiled = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
    out = []
    for label, (k, n, has_bias) in model_gemms(arch).items():
        count = 2 if label == "lm_head" else layers  # one LM head; two copies leave L2 cold
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
        weights_t = [w.t().contiguous() for w in weights]  # the same weights stored [K, N]
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
        for m in batch_sizes:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            args = [(x, w, bias) for w in weights]
            cublas, lt = graph_us(F.linear, args), cublaslt_us(args)
            flipped = graph_us(transposed_linear, [(x, w, bias) for w in weights_t])
            chosen = graph_us(compiled, args) if inductor else float("nan")
            floor_mm, floor_copy = 2 * m * n * k / flops * 1e6, 2 * n * k / bps * 1e6
            out.append((label, m, cublas, lt, flipped, chosen, floor_mm, floor_copy))
            print(*(f"{v:.2f}" if isinstance(v, float) else v for v in out[-1]), flush=True)
    return out


def gemm_parser(doc: str) -> argparse.ArgumentParser:
    """The options of the decode-GEMM scripts (this one, ``decode_splitk``): the architecture,
    the batch sizes and the number of layers (weights) per CUDA graph."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model-arch", default="qwen2-vl-2b", choices=sorted(ARCHITECTURES))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--layers", type=int, default=28)
    return parser


def main() -> None:
    parser = gemm_parser(__doc__)
    parser.add_argument("--no-inductor", action="store_true", help="skip the autotuned column")
    args = parser.parse_args()
    table = rows(args.model_arch, args.batch_sizes, args.layers, not args.no_inductor)
    columns = (
        "cuBLAS us | cuBLASLt us | cuBLAS on [K, N] us | Inductor max-autotune us | matmul floor"
        " | copy floor"
    )
    print(f"| GEMM | M | {columns} |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, m, *times in table:
        cells = (f"{v:.2f}" for v in times)
        print(f"| {label} | {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
