"""Can a Triton GEMM with the activation in its epilogue beat cuBLAS plus the activation kernel?

The encode steps' elementwise kernels run at the copy rate and take about 212 ms of workload 1's
batch on an H100 (QuickGELU 55, the tower's norms 57, rotary 40, the LM's SiLU-and-mul 38:
``kernel_profile``). Fusing QuickGELU into the tower's ``fc1`` and SiLU-and-mul into the LM's
``gate_up_proj`` removes one write and one read of their outputs, but only pays if the GEMM
itself stays near cuBLAS (nvjet) speed. This script times, per shape, ``F.linear`` and the
engine's Triton activation kernel against one persistent Triton GEMM (TMA descriptors, the
weight ``[N, K]`` as stored) whose epilogue adds the bias, rounds to bf16 as cuBLAS does, and
applies the activation with the engine's roundings (``kernels/triton_activation.py``), over a
sweep of tile configurations with ``--sweep``.

    python -m mm_serve.benchmarks.fused_gemm [--sweep]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

from mm_serve.kernels import triton_gemm
from mm_serve.kernels.triton_activation import quick_gelu_triton, silu_and_mul_triton

# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps) tried per activation besides the module's own.
SWEEP = [(128, 256, 64, 3, 8), (128, 128, 64, 3, 8), (128, 128, 64, 4, 8), (256, 128, 64, 3, 8),
         (128, 128, 128, 2, 8), (64, 256, 64, 4, 4)]  # fmt: skip
# name: (K, N, activation, bias, token counts): Qwen2-VL-2B's tower fc1 (photos of 1,024
# patches) and its LM's gate_up_proj (prefill steps).
SHAPES = {
    "tower fc1": (1280, 5120, triton_gemm.QUICK_GELU, True, [1024, 4096, 16384, 26624]),
    "LM gate_up": (1536, 2 * 8960, triton_gemm.SILU_AND_MUL, False, [512, 1024, 2048, 8192]),
}


def _us(fn, *args) -> float:
    """Median microseconds of ``fn(*args)`` (``triton.testing.do_bench``)."""
    return triton.testing.do_bench(lambda: fn(*args), rep=100) * 1e3


def _unfused(act_fn, x, w, bias):
    return act_fn(F.linear(x, w, bias))


def rows(sweep: bool) -> list[tuple]:
    """``(shape, M, config, unfused us, fused us, max relative difference)``, printed as made."""
    out = []
    fused_fn = triton_gemm.linear_act_triton
    for name, (k, n, act, has_bias, token_counts) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
        act_fn = quick_gelu_triton if act == triton_gemm.QUICK_GELU else silu_and_mul_triton
        default = triton_gemm.CONFIGS[act]
        for m in token_counts:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = _unfused(act_fn, x, w, bias)
            unfused = _us(_unfused, act_fn, x, w, bias)
            for config in [default] + ([c for c in SWEEP if c != default] if sweep else []):
                triton_gemm.CONFIGS[act] = config
                try:
                    y = fused_fn(x, w, bias, act)
                    fused = _us(fused_fn, x, w, bias, act)
                except Exception as e:  # a config this Triton cannot build (shared memory)
                    print(f"{name:<10} {m:>6} {config!s:<24} {type(e).__name__}")
                    continue
                diff = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                out.append((name, m, config, unfused, fused, diff))
                times = f"unfused {unfused:8.1f} us  fused {fused:8.1f} us  {fused / unfused:.3f}"
                print(f"{name:<10} {m:>6} {config!s:<24} {times}  max rel diff {diff:.1e}")
            triton_gemm.CONFIGS[act] = default
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep", action="store_true", help="also time the SWEEP configs")
    rows(parser.parse_args().sweep)


if __name__ == "__main__":
    main()
