"""The vision towers' attention on same-size images, for ``mm-serve bench kernels``: what the
tower runs (``dispatch.varlen_attention``: the Triton segment kernel on equal segments where it
is used) against FlashAttention-2's varlen kernel, cuDNN's attention in one call over all the
images (the tower's path before the Triton kernel), cuDNN on the same heads zero-padded to 96
and 128 channels (the padding done before timing), and batched SDPA (torch's choice of backend).

Qwen2-VL's tower (16 heads of 80, bf16) over 16 images of 448x448 (1,024 patches each: one
graphed tower chunk) and 21 (about one encode step of the image workload), and SigLIP-so400m's
(16 heads of 72) over 16 images of 729 patches. Each method is checked once against float32
attention, then timed.

``triton_config_rows``: the Triton kernel's tiles, warps and stages swept on one case (the
engine's ``DEFAULT_CONFIG`` is the best of this sweep on an H200).
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F

from mm_serve.benchmarks.kernels import bench, rel_err
from mm_serve.kernels import varlen_attention as varlen
from mm_serve.kernels.dispatch import varlen_attention, varlen_segments
from mm_serve.kernels.triton_segment_attention import segment_attention_triton

CASES = (  # name, number of images, patches per image, heads, head dim
    ("Qwen2-VL 16 x 1024, 16x80", 16, 1024, 16, 80),
    ("Qwen2-VL 21 x 1024, 16x80", 21, 1024, 16, 80),
    ("SigLIP 16 x 729, 16x72", 16, 729, 16, 72),
)


def vision_attention_rows() -> list[dict]:
    """One row per case and method: ms, TFLOP/s (``4 * len**2 * heads * head_dim`` per
    image) and the relative error against float32 attention."""
    return [row for case in CASES for row in _case_rows(*case)]


def _case_rows(name: str, images: int, length: int, heads: int, head_dim: int) -> list[dict]:
    device = torch.device("cuda")
    q, k, v = (
        torch.randn(images * length, heads, head_dim, device=device, dtype=torch.bfloat16)
        for _ in range(3)
    )
    segments = varlen_segments([i * length for i in range(images + 1)], device, q.dtype)
    batched = [t.view(images, length, heads, head_dim).transpose(1, 2) for t in (q, k, v)]
    methods = {
        "engine (varlen_attention)": lambda: varlen_attention(q, k, v, segments),
        "FlashAttention-2 varlen": lambda: varlen.flash_varlen(
            q, k, v, segments.cu_seqlens, length, causal=False
        ),
    }
    if torch.backends.cudnn.is_available():
        methods["cuDNN, one call"] = _padded_cudnn(q, k, v, length, head_dim)
        for padded in (96, 128):
            methods[f"cuDNN, head_dim {padded}"] = _padded_cudnn(q, k, v, length, padded)
    methods["SDPA batched"] = lambda: (
        F.scaled_dot_product_attention(*batched).transpose(1, 2).reshape(q.shape)
    )
    reference = _float32_attention(q, k, v, length)
    flops = 4 * images * length**2 * heads * head_dim
    rows = []
    for method, fn in methods.items():
        error = rel_err(fn(), reference)
        ms = bench(fn)
        rows.append(dict(case=name, method=method, ms=ms, tflops=flops / ms / 1e9, rel_err=error))
    return rows


def _float32_attention(q, k, v, length: int) -> torch.Tensor:
    """Attention within each ``length``-row segment in float32, one segment at a time."""
    out = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    for start in range(0, q.shape[0], length):
        qs, ks, vs = (t[start : start + length].float().transpose(0, 1) for t in (q, k, v))
        scores = torch.softmax(qs @ ks.transpose(1, 2) * q.shape[-1] ** -0.5, dim=-1)
        out[start : start + length] = (scores @ vs).transpose(0, 1)
    return out


def triton_config_rows(case=CASES[0]) -> list[dict]:
    """``segment_attention_triton`` over tiles (BLOCK_M, BLOCK_N), warps and stages on one
    case, ``v`` a strided view of a fused qkv output as in the towers: ms and TFLOP/s each."""
    _, images, length, heads, head_dim = case
    qkv = torch.randn(images * length, 3, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q, k = qkv[:, 0].contiguous(), qkv[:, 1].contiguous()
    v = qkv[:, 2]
    cu_seqlens = torch.arange(images + 1, device="cuda", dtype=torch.int32) * length
    flops = 4 * images * length**2 * heads * head_dim
    rows = []
    for config in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        run = functools.partial(segment_attention_triton, q, k, v, cu_seqlens, length, config)
        try:
            ms = bench(run)
        except Exception as error:  # out of shared memory or registers for this tile
            rows.append(dict(config=config, ms=float("nan"), tflops=0.0, error=repr(error)[:80]))
            continue
        rows.append(dict(config=config, ms=ms, tflops=flops / ms / 1e9))
    return sorted(rows, key=lambda r: r["tflops"], reverse=True)


def _padded_cudnn(q, k, v, length: int, padded: int):
    """cuDNN's attention in one call over all the segments of ``q, k, v`` zero-padded to
    ``padded`` channels per head (padded once, outside the timed call; ``padded == head_dim``:
    as they are), scale ``head_dim ** -0.5``: the same scores and, in the first ``head_dim``
    channels, the same output, through cuDNN's kernel for the wider head."""
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


def print_vision_attention(rows: list[dict]) -> None:
    print("\nVision tower attention (bf16, same-size images)")
    print(f"{'case':28} {'method':28} {'ms':>8} {'TFLOP/s':>8} {'rel err':>9}")
    for r in rows:
        print(
            f"{r['case']:28} {r['method']:28} {r['ms']:8.3f} {r['tflops']:8.0f} {r['rel_err']:9.1e}"
        )
