"""The tower block's residual add in cuBLAS's GEMM (``residual.addmm_(a, W.T)``, beta = 1)
against the engine's form (``F.linear`` with its bias, then the add fused into the next norm).

    python -m mm_serve.benchmarks.residual_gemm [--rows 16384 26624] [--iters 30]

Per row count and GEMM (Qwen2-VL-2B's tower: ``proj`` 1280 -> 1280, ``fc2`` 5120 -> 1280, bf16),
one CUDA graph of 8 back-to-back calls per form (``decode_gemms.graph_us``: median device us
per call):
- ``engine``: ``y = F.linear(a, W, b)``, then ``layer_norm_triton(y, residual=r)`` (reads two
  tensors, writes two);
- ``addmm``: ``r.addmm_(a, W.T)`` in place, then ``layer_norm_triton(r)`` (reads one, writes
  one; the GEMM's bias would then ride in the norm as a vector, not timed apart);
- ``linear alone`` and ``addmm_ alone``: the two GEMMs without their norms, to see what beta = 1
  costs cuBLAS; and ``addmm_``'s relative error against float32.
"""

from __future__ import annotations

import argparse

import torch

from mm_serve.benchmarks.decode_gemms import graph_us
from mm_serve.kernels.triton_norm import layer_norm_triton

DIM, GEMMS = 1280, {"proj": 1280, "fc2": 5120}
CALLS = 8


def rows_for(num_rows: int, k: int, iters: int) -> dict[str, float]:
    """us per call of each form for one GEMM of ``[num_rows, k] x [k, DIM]``."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05

    a, weight, bias = randn(num_rows, k), randn(DIM, k), randn(DIM)
    residual = randn(num_rows, DIM)
    y = torch.empty_like(residual)  # F.linear's output (written by ``addmm.out``)
    norm_w, norm_b = randn(DIM) + 1, randn(DIM)
    normed, res_out = torch.empty_like(y), torch.empty_like(y)

    def engine():
        torch.ops.aten.addmm.out(bias, a, weight.t(), out=y)
        layer_norm_triton(y, norm_w, norm_b, 1e-6, residual, out=normed, residual_out=res_out)

    def addmm():
        residual.addmm_(a, weight.t())
        layer_norm_triton(residual, norm_w, norm_b, 1e-6, out=normed)

    forms = {
        "engine": engine,
        "addmm": addmm,
        "linear alone": lambda: torch.ops.aten.addmm.out(bias, a, weight.t(), out=y),
        "addmm_ alone": lambda: residual.addmm_(a, weight.t()),
    }
    with torch.inference_mode():
        check = residual.float() + a.float() @ weight.float().t()
        got = residual.clone().addmm_(a, weight.t()).float()
        err = ((got - check).norm() / check.norm()).item()
        result = {name: graph_us(fn, [()] * CALLS, iters) for name, fn in forms.items()}
    result["addmm_ rel err"] = err
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16384, 26624])
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, us per call (median of {args.iters} graph replays)")
    for num_rows in args.rows:
        for name, k in GEMMS.items():
            result = rows_for(num_rows, k, args.iters)
            cells = ", ".join(f"{key} {value:.4g}" for key, value in result.items())
            print(f"{name} {num_rows} x {k}: {cells}")


if __name__ == "__main__":
    main()
