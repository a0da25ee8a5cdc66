"""The vision towers' attention on same-size images, for ``mm-serve bench kernels``: what the
tower runs (``dispatch.varlen_attention``: cuDNN on equal segments where it is used) against
FlashAttention-2's varlen kernel, cuDNN in one call over all the images, batched SDPA (torch's
choice of backend, then its flash and its memory-efficient kernels alone), and cuDNN on the
same heads zero-padded to 96 and 128 channels (the padding done before timing). A method that
raises (a shape the library does not take) gets an error row.

Qwen2-VL's tower (16 heads of 80, bf16) over 21 images of 448x448 (1,024 patches each, about
one encode step of the image workload), and SigLIP-so400m's (16 heads of 72) over 16 images
of 729 patches. Each method is timed, then checked against the float32 reference
(``segment_attention_ref``).

``plan_cost_rows``: the first and the second call of cuDNN's attention on a batch count it has
not seen (one call over all the images, ``varlen_attention.cudnn_segments``), against the
engine's path, whose power-of-two parts are planned by then.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mm_serve.benchmarks.kernel_timing import bench, rel_err
from mm_serve.kernels import varlen_attention as varlen
from mm_serve.kernels.dispatch import varlen_attention, varlen_segments

CASES = (  # name, number of images, patches per image, heads, head dim
    ("Qwen2-VL 21 x 1024, 16x80", 21, 1024, 16, 80),
    ("SigLIP 16 x 729, 16x72", 16, 729, 16, 72),
)


def vision_attention_rows() -> list[dict]:
    """One row per case and method: ms, TFLOP/s (``4 * len**2 * heads * head_dim`` per
    image) and the relative error against the float32 reference."""
    return [row for case in CASES for row in _case_rows(*case)]


def _case_rows(name: str, images: int, length: int, heads: int, head_dim: int) -> list[dict]:
    device = torch.device("cuda")
    q, k, v = (
        torch.randn(images * length, heads, head_dim, device=device, dtype=torch.bfloat16)
        for _ in range(3)
    )
    bounds = [i * length for i in range(images + 1)]
    segments = varlen_segments(bounds, device, q.dtype)
    batched = [t.view(images, length, heads, head_dim).transpose(1, 2) for t in (q, k, v)]

    methods = {
        "engine (varlen_attention)": lambda: varlen_attention(q, k, v, segments),
        "FlashAttention-2 varlen": lambda: varlen.flash_varlen(
            q, k, v, segments.cu_seqlens, length, causal=False
        ),
    }
    if varlen.has_dense_cudnn(device):
        methods["cuDNN dense"] = lambda: varlen.dense_attention(q, k, v, length)
        for padded in (96, 128):
            methods[f"cuDNN, head_dim {padded}"] = _padded_cudnn(q, k, v, length, padded)
        methods["cuDNN, one call"] = lambda: varlen.cudnn_segments(q, k, v, length)
    # Last: on the twelfth session's GPU image, cuDNN's attention after a bf16 SDPA call on
    # these shapes ended in an illegal memory access (BENCHMARKS.md).
    methods["SDPA batched"] = lambda: (
        F.scaled_dot_product_attention(*batched).transpose(1, 2).reshape(q.shape)
    )
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        methods[f"SDPA batched, {backend.name.lower()}"] = _sdpa_with(backend, batched, q.shape)
    groups = varlen.make_segments(bounds, device, flash=False)  # float32 SDPA: not cuDNN's
    reference = varlen.segment_attention_ref(q.float(), k.float(), v.float(), groups)
    flops = 4 * images * length**2 * heads * head_dim
    rows = []
    for method, fn in methods.items():
        try:
            error = rel_err(fn(), reference)
        except RuntimeError as exc:  # a shape another library's kernel does not take
            if method.startswith("engine"):
                raise
            rows.append(dict(case=name, method=method, error=repr(exc)[:200]))
            continue
        ms = bench(fn)
        rows.append(dict(case=name, method=method, ms=ms, tflops=flops / ms / 1e9, rel_err=error))
    return rows


def _sdpa_with(backend: SDPBackend, batched: list[torch.Tensor], shape: torch.Size):
    """SDPA over ``batched`` ``[images, heads, length, head_dim]`` views through ``backend``
    alone, its output packed back to ``shape``."""

    def run():
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(*batched)
        return out.transpose(1, 2).reshape(shape)

    return run


def _padded_cudnn(q, k, v, length: int, padded: int):
    """cuDNN's attention on ``q, k, v`` zero-padded to ``padded`` channels per head (padded
    once, outside the timed call), scale ``head_dim ** -0.5``: the same scores and, in the
    first ``head_dim`` channels, the same output, through cuDNN's kernel for the wider head."""
    n, heads, head_dim = q.shape
    views = []
    for t in (q, k, v):
        wide = F.pad(t, (0, padded - head_dim)).view(n // length, length, heads, padded)
        views.append(wide.transpose(1, 2))
    scale = head_dim**-0.5

    def run():
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(*views, None, False, scale=scale)
        return out[0].transpose(1, 2).reshape(n, heads, padded)[..., :head_dim]

    return run


def plan_cost_rows(counts=(12, 13, 26, 27), length: int = 1024) -> list[dict]:
    """Per image count (Qwen2-VL's 16 heads of 80, ``length`` patches each): ms of the first
    and of a second one-call cuDNN attention, and of the engine's ``dense_attention`` once
    every power-of-two part is planned (host wall time to a device synchronisation)."""

    def wall_ms(fn, q: torch.Tensor) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(q, q, q, length)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    def images(count: int) -> torch.Tensor:
        return torch.randn(count * length, 16, 80, device="cuda", dtype=torch.bfloat16)

    varlen.dense_attention(*[images(2 * varlen.MAX_DENSE_BATCH - 1)] * 3, length)  # all parts
    return [
        {
            "images": count,
            "one call, first": wall_ms(varlen.cudnn_segments, q),
            "one call, again": wall_ms(varlen.cudnn_segments, q),
            "in parts": wall_ms(varlen.dense_attention, q),
        }
        for count, q in ((count, images(count)) for count in counts)
    ]


def print_plan_cost(rows: list[dict]) -> None:
    print("\ncuDNN attention on a new image count, 1,024 patches each (ms, host wall time)")
    print(f"{'images':>6} {'one call, first':>16} {'one call, again':>16} {'in parts':>9}")
    for r in rows:
        print(
            f"{r['images']:6d} {r['one call, first']:16.1f} {r['one call, again']:16.2f} "
            f"{r['in parts']:9.2f}"
        )


def print_vision_attention(rows: list[dict]) -> None:
    print("\nVision tower attention (bf16, same-size images)")
    print(f"{'case':28} {'method':28} {'ms':>8} {'TFLOP/s':>8} {'rel err':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:28} {r['method']:28} failed: {r['error'][:60]}")
            continue
        print(
            f"{r['case']:28} {r['method']:28} {r['ms']:8.3f} {r['tflops']:8.0f} {r['rel_err']:9.1e}"
        )
