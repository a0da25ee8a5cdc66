"""Time the linear layers of a batch-1 decode step: the Triton GEMV against cuBLAS.

Run: ``python -m mm_serve.benchmarks.gemv [--arch qwen2-vl-2b] [--sweep] [--out DIR]``.
The shapes are one decoder layer's projections of the architecture (qkv with its bias, o,
gate_up, and down with the SiLU-and-mul fused in front). A model reads each weight once per
step and all the others in between, so every call here uses a different copy of the weight
(at least 3x the L2 cache in all): the timing is the HBM-bound one of a real step, not an
L2-resident loop. The calls of one case are captured in a CUDA graph and the graph is replayed;
the figure is the mean per call in microseconds, with the weight bytes over that time in TB/s.
``--sweep`` times a grid of launch configs and prints the best three per shape. Each case
runs with programmatic dependent launch off and on (``KernelConfig.pdl``); qkv and gate_up also
with the RMSNorm fused in front (PDL on), against the norm kernel followed by cuBLAS.
A script, not a test: each case is checked against ``F.linear`` once before timing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F

from mm_serve.benchmarks.architectures import ARCHITECTURES
from mm_serve.config import KernelConfig
from mm_serve.kernels.activation import silu_and_mul_ref
from mm_serve.kernels.dispatch import configure_kernels

L2_BYTES = 50 * 2**20  # H100 and H200: 50 MiB


def layer_shapes(arch: str) -> list[tuple[str, int, int, bool, bool]]:
    """``(name, out_features, in_features, bias, gated)`` of one decoder layer's linears."""
    text = ARCHITECTURES[arch].get("text_config", ARCHITECTURES[arch])  # nested for LLaVA-OV
    hidden, inter = text["hidden_size"], text["intermediate_size"]
    head_dim = hidden // text["num_attention_heads"]
    qkv = hidden + 2 * text["num_key_value_heads"] * head_dim
    return [
        ("qkv_proj", qkv, hidden, True, False),
        ("o_proj", hidden, hidden, False, False),
        ("gate_up_proj", 2 * inter, hidden, False, False),
        ("down_proj", hidden, inter, False, True),
    ]


def time_calls(fn, copies: int, replays: int = 20) -> float:
    """Mean microseconds per call of ``fn(i)`` for ``i`` in ``range(copies)``, graph-replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles) outside the capture
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * copies)


def make_case(out_features, in_features, bias, gated, dtype=torch.bfloat16):
    weight_bytes = out_features * in_features * 2
    copies = max(2, -(-3 * L2_BYTES // weight_bytes))
    weights = [
        torch.randn(out_features, in_features, device="cuda", dtype=dtype) / in_features**0.5
        for _ in range(copies)
    ]
    b = torch.randn(out_features, device="cuda", dtype=dtype) if bias else None
    x = torch.randn(1, in_features * (2 if gated else 1), device="cuda", dtype=dtype)
    return weights, b, x, weight_bytes


def run_case(shape, configs: list[dict | None], pdl: bool) -> list[dict]:
    """cuBLAS (with the SiLU-and-mul kernel before a gated layer), then the GEMV under each
    config, for one shape."""
    from mm_serve.kernels.triton_linear import gemv_triton

    name, n, k, bias, gated = shape
    weights, b, x, weight_bytes = make_case(n, k, bias, gated)
    configure_kernels(KernelConfig(pdl=pdl))

    def cublas(i):
        return F.linear(silu_and_mul_ref(x) if gated else x, weights[i], b)

    ref = cublas(0).float()
    rows = [{"layer": name, "impl": "cuBLAS", "config": None, "pdl": False,
             "us": time_calls(cublas, len(weights))}]  # fmt: skip
    for cfg in configs:
        out = gemv_triton(x, weights[0], b, gated, config=cfg).float()
        err = ((out - ref).norm() / ref.norm()).item()

        def call(i, c=cfg):
            return gemv_triton(x, weights[i], b, gated, config=c)

        us = time_calls(call, len(weights))
        rows.append({"layer": name, "impl": "triton", "config": cfg, "pdl": pdl,
                     "us": us, "rel_err": err})  # fmt: skip
    for row in rows:
        row["tb_s"] = weight_bytes / (row["us"] * 1e-6) / 1e12
    return rows


def run_norm_case(shape, configs: list[dict | None]) -> list[dict]:
    """The RMSNorm (with the residual add) fused in front of ``shape``'s GEMV, PDL on,
    against cuBLAS after the Triton RMSNorm kernel."""
    from mm_serve.kernels.triton_linear import rms_norm_gemv_triton
    from mm_serve.kernels.triton_norm import rms_norm_triton

    name, n, k, bias, _ = shape
    weights, b, x, weight_bytes = make_case(n, k, bias, False)
    residual, norm_weight = torch.randn_like(x), torch.rand(k, device="cuda", dtype=x.dtype)
    configure_kernels(KernelConfig(pdl=True))

    def unfused(i):
        return F.linear(rms_norm_triton(x, norm_weight, 1e-6, residual)[0], weights[i], b)

    rows = [{"layer": f"norm+{name}", "impl": "norm+cuBLAS", "config": None, "pdl": True,
             "us": time_calls(unfused, len(weights))}]  # fmt: skip
    for cfg in configs:

        def call(i, c=cfg):
            return rms_norm_gemv_triton(x, residual, norm_weight, 1e-6, weights[i], b, c)

        rows.append({"layer": f"norm+{name}", "impl": "triton", "config": cfg, "pdl": True,
                     "us": time_calls(call, len(weights))})  # fmt: skip
    for row in rows:
        row["tb_s"] = weight_bytes / (row["us"] * 1e-6) / 1e12
    return rows


def sweep_configs() -> list[dict]:
    grid = itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (4, 8), (1, 3))
    return [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": s}
            for bn, bk, w, s in grid if 8 <= bn * bk // (32 * w) <= 64]  # fmt: skip


def print_rows(rows: list[dict]) -> None:
    print(f"{'layer':<13} {'impl':<8}{'pdl':>4}{'us':>8}{'TB/s':>7}  config")
    for r in rows:
        cfg = "" if r["config"] is None else json.dumps(r["config"])
        pdl = "on" if r["pdl"] else "off"
        print(f"{r['layer']:<13} {r['impl']:<8}{pdl:>4}{r['us']:>8.2f}{r['tb_s']:>7.2f}  {cfg}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen2-vl-2b", choices=sorted(ARCHITECTURES))
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = parser.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), args.arch)
    rows = []
    for shape in layer_shapes(args.arch):
        if shape[0] in ("qkv_proj", "gate_up_proj"):  # the projections after a norm
            found = run_norm_case(shape, sweep_configs() if args.sweep else [None])
            print_rows([found[0], *sorted(found[1:], key=lambda r: r["us"])[:3]])
            rows += found
        for pdl in (False, True):
            found = run_case(shape, sweep_configs() if args.sweep else [None], pdl)
            print_rows([found[0], *sorted(found[1:], key=lambda r: r["us"])[:3]])
            rows += found
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"gemv_{args.arch}.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
