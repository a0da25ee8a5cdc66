"""Kernels of the model forward, each with a pure-torch reference (``*_ref``) beside it.

The names without suffix are what the layers call: they dispatch per call (see
:mod:`mm_serve.kernels.dispatch`) to the Triton kernels (``triton_*.py``; flash_attn for
attention when it can serve the cache) for CUDA tensors and to the references otherwise, so
the CPU path runs exactly the references. ``MM_SERVE_KERNELS=ref`` forces the references
everywhere. A kernel keeps its reference's signature and return convention (e.g.
``apply_rotary`` returns new tensors, ``reshape_and_cache`` writes in place).
"""

from __future__ import annotations

# Run from the repository root, this folder is also found as a top-level ``kernels``, the name
# of Hugging Face's kernels package; transformers' probe for that package
# (``is_kernels_available``) imports it when no distribution named ``kernels`` is installed. As
# anything but ``mm_serve.kernels`` it defines nothing, so the probe finds no version and
# reports the package unavailable instead of failing on ``mm_serve.kernels`` imports.
if __name__ == "mm_serve.kernels":
    from mm_serve.kernels.activation import quick_gelu_ref, silu_and_mul_ref
    from mm_serve.kernels.attention import paged_attention_ref, reshape_and_cache_ref
    from mm_serve.kernels.dispatch import (
        apply_mrotary,
        apply_rotary,
        kernel_mode,
        layer_norm,
        paged_attention,
        reshape_and_cache,
        rms_norm,
        silu_and_mul,
    )
    from mm_serve.kernels.dispatch_linear import linear, rms_norm_linear, silu_and_mul_linear
    from mm_serve.kernels.linear import linear_ref, rms_norm_linear_ref, silu_and_mul_linear_ref
    from mm_serve.kernels.norm import layer_norm_ref, rms_norm_ref
    from mm_serve.kernels.rotary import apply_mrotary_ref, apply_rotary_ref

    __all__ = [
        "apply_mrotary",
        "apply_mrotary_ref",
        "apply_rotary",
        "apply_rotary_ref",
        "kernel_mode",
        "layer_norm",
        "layer_norm_ref",
        "linear",
        "linear_ref",
        "paged_attention",
        "paged_attention_ref",
        "reshape_and_cache",
        "reshape_and_cache_ref",
        "rms_norm",
        "rms_norm_linear",
        "rms_norm_linear_ref",
        "rms_norm_ref",
        "silu_and_mul",
        "silu_and_mul_linear",
        "silu_and_mul_linear_ref",
        "quick_gelu_ref",
        "silu_and_mul_ref",
    ]
