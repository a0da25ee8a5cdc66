"""Which cuBLAS kernel each token count gets, for the LM's linear layers.

The first launch of a cuBLAS kernel in a process waits until the device has run everything
queued (BENCHMARKS.md), so an eager step whose GEMM picks a kernel not launched before stalls
the engine's launch-ahead; start-up launches them first (``worker.gemm_warmup``). This script
lists, for each GEMM that warm-up launches (the model built on ``meta``, ``lm_gemm_shapes``:
``[M, K] x [K, N]``, bf16, with its bias or without), the kernels cuBLAS runs for every ``M`` in
``1..--max-tokens`` (``1..--max-num-seqs`` for the LM head: the sampled rows), and whether
calling every ``--stride``-th ``M`` launches them all.

    python -m mm_serve.benchmarks.gemm_kernels --model-arch qwen2-vl-2b --max-tokens 8192
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
import torch.nn.functional as F

from mm_serve.benchmarks.architectures import ARCHITECTURES, _build_config
from mm_serve.models.registry import get_model_class
from mm_serve.worker.gemm_warmup import lm_gemm_shapes

MARKER = "spin"  # torch.cuda._sleep's kernel name holds it: one between two calls


def model_gemms(name: str) -> dict[str, tuple[int, int, bool]]:
    """``{label: (K, N, has_bias)}`` of the GEMMs ``warm_gemm_kernels`` launches for
    architecture ``name``: its LM's (``lm_gemm_shapes``) and its LM head's (label
    ``lm_head``)."""
    config = _build_config(name, {})
    with torch.device("meta"):
        model = get_model_class(config)(config)
    gemms = {}
    for weight, bias in lm_gemm_shapes(model):
        n, k = weight.shape
        gemms[f"{n}x{k}" + (" + bias" if bias is not None else "")] = (k, n, bias is not None)
    n, k = model.lm_head.weight.shape
    return {**gemms, "lm_head": (k, n, False)}


def kernels_per_m(k: int, n: int, bias: bool, ms: list[int]) -> dict[int, tuple[str, ...]]:
    """``{M: names of the kernels one F.linear call launched}`` (profiled, one marker kernel
    between calls)."""
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.01
    b = torch.zeros(n, device="cuda", dtype=torch.bfloat16) if bias else None
    x = torch.randn(max(ms), k, device="cuda", dtype=torch.bfloat16)
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for m in ms:
            F.linear(x[:m], weight, b)
            torch.cuda._sleep(1)
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    calls, current = [], []
    for event in kernels:
        if MARKER in event.name:
            calls.append(tuple(current))
            current = []
        elif not event.name.startswith("Memset"):
            current.append(event.name)
    return dict(zip(ms, calls, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-arch", choices=sorted(ARCHITECTURES), default="qwen2-vl-2b")
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--stride", type=int, nargs="+", default=[8, 16, 64])
    args = parser.parse_args()
    for name, (k, n, bias) in model_gemms(args.model_arch).items():
        max_m = args.max_num_seqs if name == "lm_head" else args.max_tokens
        chosen = kernels_per_m(k, n, bias, list(range(1, max_m + 1)))
        first_m: dict[str, int] = {}
        num_ms: Counter[str] = Counter()
        for m, names in chosen.items():
            for kernel in names:
                first_m.setdefault(kernel, m)
                num_ms[kernel] += 1
        print(f"{name}: K={k} N={n} bias={bias}: {len(first_m)} kernels")
        for kernel, m in sorted(first_m.items(), key=lambda item: item[1]):
            print(f"  first M {m:5d}, {num_ms[kernel]:5d} Ms: {kernel[:90]}")
        for stride in args.stride:
            swept = {1, *range(stride, max_m + 1, stride)}
            covered = {kernel for m in swept for kernel in chosen[m]}
            missed = sorted(set(first_m) - covered)
            print(f"  every {stride}th M (and 1): misses {len(missed)} kernels")


if __name__ == "__main__":
    main()
