"""Time the quantized linear, fused MoE, LoRA and FP8-KV attention kernels on a CUDA device
against the bf16 kernels they stand beside, each checked against its reference first.

Run: ``mm-serve bench kernels --layers`` (``kernels.main``). Every call is timed inside a CUDA
graph (``kernel_timing.time_calls``: no host launch time), in microseconds.

- Linear layers at Qwen2.5-VL-7B's shapes for 1, 16, 256 and 2,048 tokens: cuBLAS bf16, FP8
  per channel (cuBLASLt row-wise), FP8 128 x 128 blocks (cuBLASLt, and our Triton GEMM), W4A16
  groups of 128 (Triton); with the weight bytes each streams per microsecond.
- The fused MoE at Qwen3-VL-30B-A3B's shapes (128 experts of width 768, hidden 2,048, top 8)
  for 1 to 2,048 tokens: the Triton grouped GEMMs against the torch path of the same blocks.
- LoRA shrink and expand at rank 16 on a 2B's ``qkv`` for 1 to 2,048 tokens over 8 adapters,
  and the base GEMM they ride on.
- Workload 1's decode attention (256 requests of 306-434 keys, 12 / 2 heads) on an FP8 cache
  against the bf16 cache.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from mm_serve.benchmarks.kernel_timing import paged_batch, rel_err, time_calls
from mm_serve.kernels.dispatch_quant import fp8_linear, int4_linear
from mm_serve.kernels.quant_linear import (
    fp8_linear_ref,
    int4_linear_ref,
    pack_int4,
    quantize_weight,
)

LINEAR_SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584),
                 "down": (3584, 18944)}  # fmt: skip
TOKENS = (1, 16, 256, 2048)


def _us(fn) -> float:
    return time_calls(lambda _: fn(), copies=10)


def _quantized(weight: torch.Tensor) -> dict:
    """The ways one bf16 weight ``[N, K]`` is held: FP8 rows, FP8 blocks, packed INT4."""
    rows, blocks = quantize_weight(weight, "fp8"), quantize_weight(weight, "fp8", 128, 128)
    int4 = quantize_weight(weight, "int4", 128)
    return {
        "rows": rows,
        "blocks": blocks | {"compact": blocks["weight_scale"][::128].contiguous()},
        "int4": int4 | {"packed": pack_int4(int4["weight"], 128)},
    }


def _linear_calls(x: torch.Tensor, weight: torch.Tensor, q: dict) -> dict:
    """Each method's call on ``x``, checked against its reference."""
    rows, blocks, int4 = q["rows"], q["blocks"], q["int4"]
    scale = int4["weight_scale"].to(x.dtype)
    calls = {
        "bf16": lambda: F.linear(x, weight),
        "fp8_channel": lambda: fp8_linear(x, rows["weight"], rows["weight_scale"], None, None),
        "fp8_blocks_cublaslt": lambda: fp8_linear(
            x, blocks["weight"], blocks["weight_scale"], None, 128, blocks["compact"]
        ),
        "fp8_blocks_triton": lambda: fp8_linear(
            x, blocks["weight"], blocks["weight_scale"], None, 128
        ),
        "w4a16": lambda: int4_linear(x, int4["packed"], scale, None, 128),
    }
    refs = {
        "fp8_channel": fp8_linear_ref(x, rows["weight"], rows["weight_scale"], None, None),
        "fp8_blocks_cublaslt": fp8_linear_ref(
            x, blocks["weight"], blocks["weight_scale"], None, 128
        ),
        "w4a16": int4_linear_ref(x, int4["weight"], scale, None, 128),
    }
    refs["fp8_blocks_triton"] = refs["fp8_blocks_cublaslt"]
    for name, ref in refs.items():
        assert rel_err(calls[name](), ref) < 2e-2, name
    return calls


def quant_linear_rows() -> list[dict]:
    """One row per layer, token count and method: microseconds and weight GB/s."""
    out = []
    for layer, (n, k) in LINEAR_SHAPES.items():
        weight = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        q = _quantized(weight.float())
        for tokens in TOKENS:
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            for method, call in _linear_calls(x, weight, q).items():
                us = _us(call)
                nbytes = {"bf16": 2.0, "w4a16": 0.5}.get(method, 1.0) * n * k
                out.append({"layer": layer, "tokens": tokens, "method": method, "us": us,
                            "weight_GBps": nbytes / us / 1e3})  # fmt: skip
    return out


def moe_rows() -> list[dict]:
    """The fused MoE at Qwen3-VL-30B-A3B's shapes: Triton against the torch path."""
    from mm_serve.kernels.moe import fused_experts_ref, topk_softmax
    from mm_serve.kernels.triton_moe import fused_experts_triton

    experts, hidden, width, top_k = 128, 2048, 768, 8
    w13 = torch.randn(experts, 2 * width, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, width, device="cuda", dtype=torch.bfloat16) * 0.02
    out = []
    for tokens in (1, 16, 64, 256, 2048):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(tokens, experts, device="cuda")
        weights, ids = topk_softmax(logits, top_k, renormalize=True)
        args = (x, w13, w2, weights, ids)
        assert rel_err(fused_experts_triton(*args), fused_experts_ref(*args)) < 2e-2
        for method, fn in (("triton", fused_experts_triton), ("torch_blocks", fused_experts_ref)):
            us = _us(lambda f=fn, a=args: f(*a))
            out.append({"tokens": tokens, "method": method, "us": us})
    return out


def lora_rows() -> list[dict]:
    """Rank-16 LoRA on a 2B's ``qkv`` (``[2048, 1536]``) over 8 adapters, tokens spread over
    them: the base GEMM, shrink, expand."""
    from mm_serve.kernels.lora import lora_expand_ref, lora_shrink_ref
    from mm_serve.kernels.triton_lora import lora_expand_triton, lora_shrink_triton

    n, k, rank, loras = 2048, 1536, 16, 8
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    lora_a = torch.randn(loras, rank, k, device="cuda", dtype=torch.bfloat16) * 0.02
    lora_b = torch.randn(loras, n, rank, device="cuda", dtype=torch.bfloat16) * 0.02
    out = []
    for tokens in TOKENS:
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        indices = torch.randint(-1, loras, (tokens,), device="cuda", dtype=torch.int32)
        buf = lora_shrink_triton(x, lora_a, indices)
        assert rel_err(buf, lora_shrink_ref(x, lora_a, indices)) < 2e-2
        y = torch.zeros(tokens, n, device="cuda", dtype=torch.bfloat16)
        y_ref = y.clone()
        lora_expand_triton(buf, lora_b, indices, y)
        lora_expand_ref(buf, lora_b, indices, y_ref)
        assert rel_err(y, y_ref) < 2e-2 or y_ref.abs().max() == 0
        calls = {
            "base_gemm": (F.linear, (x, weight)),
            "shrink": (lora_shrink_triton, (x, lora_a, indices)),
            "expand": (lora_expand_triton, (buf, lora_b, indices, y)),
        }
        for name, (fn, fn_args) in calls.items():
            us = _us(lambda f=fn, a=fn_args: f(*a))
            out.append({"tokens": tokens, "kernel": name, "us": us})
    return out


def fp8_kv_attention_rows() -> list[dict]:
    """Workload 1's decode attention on a bf16 and on an FP8 cache (the same keys rounded)."""
    from mm_serve.kernels.attention import paged_attention_ref
    from mm_serve.kernels.triton_attention import paged_attention_triton

    heads, rng = (12, 2, 128), random.Random(0)
    reqs = [(rng.randint(306, 434) - 1, 1) for _ in range(256)]
    q, kv, md = paged_batch(reqs, heads, 16, torch.bfloat16)
    scale = heads[2] ** -0.5
    out = []
    for name, cache in (("bf16", kv), ("fp8", kv.to(torch.float8_e4m3fn))):
        got = paged_attention_triton(q, cache, md, scale)
        assert rel_err(got, paged_attention_ref(q, cache, md, scale)) < 1e-2, name
        us = time_calls(lambda _, c=cache: paged_attention_triton(q, c, md, scale), 28)
        kv_bytes = 2 * sum(md.seq_lens_cpu) * heads[1] * heads[2] * cache.element_size()
        out.append({"cache": name, "us": us, "kv_GBps": kv_bytes / us / 1e3})
    return out


def layer_kernel_rows() -> dict:
    """Every table of this module, as ``kernels.json`` holds them."""
    return {
        "quant_linear": quant_linear_rows(),
        "fused_moe": moe_rows(),
        "lora": lora_rows(),
        "fp8_kv_attention": fp8_kv_attention_rows(),
    }


def print_layer_kernels(result: dict) -> None:
    print("Linear layers, Qwen2.5-VL-7B shapes (us per call, weight GB/s)")
    for r in result["quant_linear"]:
        print(f"  {r['layer']:8} {r['tokens']:5} {r['method']:20} {r['us']:9.1f} "
              f"{r['weight_GBps']:7.0f}")  # fmt: skip
    print("Fused MoE, Qwen3-VL-30B-A3B shapes (us per call)")
    for r in result["fused_moe"]:
        print(f"  {r['tokens']:5} {r['method']:13} {r['us']:9.1f}")
    print("LoRA rank 16 on a [2048, 1536] qkv, 8 adapters (us per call)")
    for r in result["lora"]:
        print(f"  {r['tokens']:5} {r['kernel']:10} {r['us']:9.1f}")
    print("Decode attention, 256 x 306-434 keys (us per call)")
    for r in result["fp8_kv_attention"]:
        print(f"  {r['cache']:5} {r['us']:7.1f} {r['kv_GBps']:7.0f} GB/s")
