"""Kernels of the model forward, each with a pure-torch reference (``*_ref``).

The names below are what the layers call. They point at the references for now; the Triton
kernels will be dispatched here (GPU path) once they exist, the CPU path keeps the references;
a kernel must keep its reference's signature and return convention (e.g. ``apply_rotary``
returns new tensors, ``reshape_and_cache`` writes in place).
"""

from __future__ import annotations

from mm_serve.kernels.activation import silu_and_mul_ref
from mm_serve.kernels.attention import paged_attention_ref, reshape_and_cache_ref
from mm_serve.kernels.norm import rms_norm_ref
from mm_serve.kernels.rotary import apply_rotary_ref

reshape_and_cache = reshape_and_cache_ref
paged_attention = paged_attention_ref
rms_norm = rms_norm_ref
silu_and_mul = silu_and_mul_ref
apply_rotary = apply_rotary_ref

__all__ = [
    "apply_rotary",
    "apply_rotary_ref",
    "paged_attention",
    "paged_attention_ref",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "rms_norm",
    "rms_norm_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
]
