"""Time the attention and small kernels on a CUDA device against their references and ceilings.

Run: ``python -m mm_serve.benchmarks.kernels [--sweep] [--prefill-only] [--out DIR]``. Prints
medians of ``triton.testing.do_bench`` and writes every figure to ``DIR/kernels.json``.

- Paged attention, 28 query / 4 KV heads, head dim 128, block size 16, bf16: decode 64 x 4096
  (bandwidth of K and V read once, against a 1 GiB device-to-device copy), prefill and mixed.
  ``--sweep`` also times a grid of launch configs.
- Prefill attention on Qwen2-VL-2B's shapes (12 query / 2 KV heads): 26 ~315-token prompts,
  the same with 64 decode rows mixed in, one 4,096-token prompt; each method checked against
  ``paged_attention_ref`` first; TFLOP/s counts ``4 * head_dim * num_heads`` per visible
  query-key pair.
- RMSNorm, SiLU-and-mul, rotary and the KV-cache write at a 4,096-token step of a 7B.
- Workload 1's decode attention inside a CUDA graph (``time_calls``: no host launch time).
- The vision towers' attention and cuDNN's plan cost (``vision_attention``).
- ``--layers``: only the quantized linear, fused MoE, LoRA and FP8-KV attention kernels
  (``layer_kernels``)."""

from __future__ import annotations

import argparse
import itertools
import os
import random

import torch

from mm_serve.benchmarks import vision_attention as vision
from mm_serve.benchmarks.common import write_json
from mm_serve.benchmarks.kernel_timing import bench, causal_flops, paged_batch, rel_err, time_calls
from mm_serve.benchmarks.prefill_attention import prefill_rows, print_prefill
from mm_serve.benchmarks.roofline import copy_rate
from mm_serve.kernels import (
    apply_rotary_ref,
    paged_attention_ref,
    reshape_and_cache_ref,
    rms_norm_ref,
    silu_and_mul_ref,
)
from mm_serve.kernels.varlen_attention import has_dense_cudnn


def attention_case(name, reqs, heads, block_size, configs, copy_bw) -> list[dict]:
    """Check once against the reference, then time each launch config (None: the heuristic)."""
    from mm_serve.kernels.triton_attention import launch_config, paged_attention_triton

    q, kv, md = paged_batch(reqs, heads, block_size, torch.bfloat16)
    scale = heads[2] ** -0.5
    err = rel_err(paged_attention_triton(q, kv, md, scale), paged_attention_ref(q, kv, md, scale))
    assert err < 1e-2, f"{name}: relative error {err}"
    kv_bytes = 2 * sum(md.seq_lens_cpu) * heads[1] * heads[2] * kv.element_size()
    flops = causal_flops(reqs, heads)
    group = heads[0] // heads[1]
    default = launch_config(
        group, md.max_query_len, md.max_seq_len, md.num_reqs, heads[1], q.device
    )
    rows = []
    for config in configs:
        try:
            ms = bench(lambda c=config: paged_attention_triton(q, kv, md, scale, config=c))
        except Exception as exc:  # a config that does not compile (shared memory): skip it
            rows.append({"case": name, "config": config, "error": repr(exc)[:200]})
            continue
        rows.append({
            "case": name, "config": config or default, "ms": ms, "rel_err": err,
            "kv_GBps": kv_bytes / ms / 1e6, "pct_copy_bw": 100 * kv_bytes / (ms * 1e-3) / copy_bw,
            "TFLOPs": flops / ms / 1e9,
        })  # fmt: skip
    return rows


def sweep_configs(decode: bool) -> list[dict | None]:
    """Launch configs to time: the heuristic's first, then a small grid."""
    if decode:
        grid = itertools.product([32, 64, 128], [1, 2, 3, 4, 8], [(4, 2), (4, 3), (8, 2)])
        return [None] + [
            {"BLOCK_M": 16, "TILE_N": t, "NUM_SEGMENTS": s, "num_warps": w, "num_stages": st}
            for t, s, (w, st) in grid
        ]
    grid = itertools.product([64, 128], [32, 64], [(4, 2), (8, 2), (4, 3)])
    return [None] + [
        {"BLOCK_M": m, "TILE_N": t, "NUM_SEGMENTS": 1, "num_warps": w, "num_stages": st}
        for m, t, (w, st) in grid
    ]


def sdpa_prefill_ms(reqs, heads) -> float:
    """PyTorch SDPA (its own backend choice) on the same prefills, contiguous: a yardstick."""
    num_heads, num_kv_heads, head_dim = heads
    n = reqs[0][1]
    q = torch.randn(len(reqs), num_heads, n, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(len(reqs), num_kv_heads, n, head_dim, device="cuda", dtype=torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return bench(lambda: sdpa(q, k, k, is_causal=True, enable_gqa=True))


def small_kernel_rows(copy_bw: float) -> list[dict]:
    """RMSNorm+residual, SiLU-and-mul, rotary, KV-cache write at a 4096-token step of a 7B;
    the plain-greedy argmax of workload 1's decode logits (256 x Qwen2's 151,936), on the
    model's bf16 against its float32 upcast (what the sampler did before, still its path for
    any other step)."""
    from mm_serve.kernels.triton_activation import silu_and_mul_triton
    from mm_serve.kernels.triton_cache import reshape_and_cache_triton
    from mm_serve.kernels.triton_norm import rms_norm_triton
    from mm_serve.kernels.triton_rotary import apply_rotary_triton

    t, dt = 4096, torch.bfloat16
    x, res = (torch.randn(t, 3584, device="cuda", dtype=dt) for _ in range(2))
    w = torch.randn(3584, device="cuda", dtype=dt)
    gate_up = torch.randn(t, 2 * 18944, device="cuda", dtype=dt)
    q = torch.randn(t, 28 * 128, device="cuda", dtype=dt)
    k = torch.randn(t, 4, 128, device="cuda", dtype=dt)
    cache = torch.randn(32768, 128, device="cuda")
    pos = torch.randint(0, 32768, (t,), device="cuda")
    kv_cache = torch.empty(2, 4096, 16, 4, 128, device="cuda", dtype=dt)
    slots = torch.randperm(4096 * 16, device="cuda")[:t]
    logits = torch.randn(256, 151936, device="cuda", dtype=dt)
    cases = [  # name, kernel, reference, bytes moved at least
        ("rms_norm+residual", lambda: rms_norm_triton(x, w, 1e-6, res),
         lambda: rms_norm_ref(x, w, 1e-6, res), 4 * x.nbytes),
        ("silu_and_mul", lambda: silu_and_mul_triton(gate_up),
         lambda: silu_and_mul_ref(gate_up), gate_up.nbytes * 3 // 2),
        ("rotary q+k", lambda: apply_rotary_triton(pos, q, k, cache, 128),
         lambda: apply_rotary_ref(pos, q, k, cache, 128), 2 * (q.nbytes + k.nbytes)),
        ("reshape_and_cache", lambda: reshape_and_cache_triton(k, k, kv_cache, slots),
         lambda: reshape_and_cache_ref(k, k, kv_cache, slots), 4 * k.nbytes),
        ("greedy argmax 256 x 151936", lambda: logits.argmax(-1),
         lambda: logits.float().argmax(-1), logits.nbytes),
    ]  # fmt: skip
    rows = []
    for name, kernel, ref, nbytes in cases:
        ms, ref_ms = bench(kernel), bench(ref)
        rows.append({
            "case": name, "ms": ms, "ref_ms": ref_ms, "GBps": nbytes / ms / 1e6,
            "pct_copy_bw": 100 * nbytes / (ms * 1e-3) / copy_bw,
        })  # fmt: skip
    return rows


def print_tables(copy_bw: float, rows: list[dict], sdpa_ms: float, small: list[dict]) -> None:
    """Per attention case the heuristic's config first, then the fastest configs timed."""
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    print(f"{'case':28} {'ms':>8} {'KV GB/s':>8} {'%copy':>6} {'TFLOP/s':>8}  config")
    for case in dict.fromkeys(r["case"] for r in rows):
        timed = [r for r in rows if r["case"] == case and "ms" in r]
        for r in timed[:1] + sorted(timed[1:], key=lambda r: r["ms"])[:5]:
            print(
                f"{case:28} {r['ms']:8.3f} {r['kv_GBps']:8.0f} {r['pct_copy_bw']:6.1f} "
                f"{r['TFLOPs']:8.1f}  {r['config']}"
            )
    print(f"{'SDPA prefill 4x2048 (torch)':28} {sdpa_ms:8.3f}")
    print(f"{'kernel':28} {'ms':>8} {'ref ms':>8} {'GB/s':>8} {'%copy':>6}")
    for r in small:
        print(
            f"{r['case']:28} {r['ms']:8.3f} {r['ref_ms']:8.3f} {r['GBps']:8.0f} "
            f"{r['pct_copy_bw']:6.1f}"
        )


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``mm-serve bench kernels``."""
    parser.add_argument("--sweep", action="store_true", help="time a grid of launch configs")
    parser.add_argument(
        "--prefill-only", action="store_true", help="only the prefill-attention comparison"
    )
    parser.add_argument(
        "--layers", action="store_true",
        help="only the quantized linear, fused MoE, LoRA and FP8-KV attention kernels",
    )  # fmt: skip
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for JSON")


def paged_attention_rows(sweep: bool, copy_bw: float) -> list[dict]:
    """The Triton paged-attention cases at 28/4 heads; without ``sweep`` the heuristic's
    config, twice (the spread of two timings)."""
    heads = (28, 4, 128)
    cases = [  # name, requests as (cached, new), configs to time with --sweep
        ("decode 64x4096", [(4095, 1)] * 64, sweep_configs(decode=True)),
        ("prefill 4x2048", [(0, 2048)] * 4, sweep_configs(decode=False)),
        ("mixed 512-chunk+63 decodes", [(1536, 512)] + [(2047, 1)] * 63, [None]),
    ]
    cases += [(f"decode {b}x4096", [(4095, 1)] * b, [None]) for b in (1, 8, 32, 128)]
    rows = []
    for name, reqs, configs in cases:
        rows += attention_case(name, reqs, heads, 16, configs if sweep else [None] * 2, copy_bw)
    return rows


def workload_decode_rows(copy_bw: float, sweep: bool = False) -> list[dict]:
    """Workload 1's decode attention under a CUDA graph (``time_calls``): the Qwen2-VL-2B LM's 12
    query / 2 KV heads of 128, 256 requests of 306-434 keys (its prompts and 128 outputs), the
    launch heuristic's config, the same with each program searching for its request (not
    ``ONE_QUERY``), then 1-4 KV segments; ``sweep``: a grid of tile sizes, KV segments, warps
    and stages instead."""
    from mm_serve.kernels.triton_attention import paged_attention_triton

    heads, rng = (12, 2, 128), random.Random(0)
    reqs = [(rng.randint(306, 434) - 1, 1) for _ in range(256)]
    q, kv, md = paged_batch(reqs, heads, 16, torch.bfloat16)
    scale = heads[2] ** -0.5
    err = rel_err(paged_attention_triton(q, kv, md, scale), paged_attention_ref(q, kv, md, scale))
    assert err < 1e-2, f"workload decode: relative error {err}"
    kv_bytes = 2 * sum(md.seq_lens_cpu) * heads[1] * heads[2] * kv.element_size()
    rows = []
    configs = [{"ONE_QUERY": False}] + [{"NUM_SEGMENTS": n} for n in (1, 2, 3, 4)]
    if sweep:
        grid = itertools.product([32, 64, 128], [1, 2], [2, 4, 8], [2, 3, 4])
        configs = [
            {"TILE_N": t, "NUM_SEGMENTS": s, "num_warps": w, "num_stages": st}
            for t, s, w, st in grid
        ]
    for config in (None, *configs):
        us = time_calls(lambda _, c=config: paged_attention_triton(q, kv, md, scale, config=c), 28)
        ms = us / 1e3  # 28 calls in the graph: one per layer
        rows.append({
            "case": "workload 1 decode 256x306-434", "config": config or "heuristic", "ms": ms,
            "kv_GBps": kv_bytes / ms / 1e6, "pct_copy_bw": 100 * kv_bytes / (ms * 1e-3) / copy_bw,
        })  # fmt: skip
    return rows


def print_workload_decode(rows: list[dict]) -> None:
    print("Paged attention under a CUDA graph (per call, as the decode graph replays it)")
    for r in rows:
        print(f"{r['case']:30} {r['ms'] * 1e3:7.1f} us {r['kv_GBps']:7.0f} GB/s "
              f"{r['pct_copy_bw']:5.1f}% copy  {r['config']}")  # fmt: skip


def main(args: argparse.Namespace) -> dict:
    """Run the tables, print them, write ``kernels.json``; returns what it wrote."""
    copy_bw = copy_rate("cuda")
    result = {"device": torch.cuda.get_device_name(), "copy_GBps": copy_bw / 1e9}
    if args.layers:
        from mm_serve.benchmarks import layer_kernels

        result |= layer_kernels.layer_kernel_rows()
        write_json(os.path.join(args.out, "kernels.json"), result)
        layer_kernels.print_layer_kernels(result)
        return result
    if not args.prefill_only:
        result["attention"] = paged_attention_rows(args.sweep, copy_bw)
        result["sdpa_prefill_ms"] = sdpa_prefill_ms([(0, 2048)] * 4, (28, 4, 128))
        result["small"] = small_kernel_rows(copy_bw)
        result["workload_decode"] = workload_decode_rows(copy_bw, args.sweep)
    result["prefill_attention"] = prefill_rows()
    path = os.path.join(args.out, "kernels.json")
    write_json(path, result)  # kept should the vision rows fail (BENCHMARKS.md)
    if not args.prefill_only:
        print_tables(copy_bw, result["attention"], result["sdpa_prefill_ms"], result["small"])
        print_workload_decode(result["workload_decode"])
    print_prefill(result["prefill_attention"])
    result["vision_attention"] = vision.vision_attention_rows()
    if has_dense_cudnn(torch.device("cuda")):
        result["vision_plan_cost"] = vision.plan_cost_rows()
    write_json(path, result)
    vision.print_vision_attention(result["vision_attention"])
    if "vision_plan_cost" in result:
        vision.print_plan_cost(result["vision_plan_cost"])
    return result


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(cli)
    main(cli.parse_args())
