"""Pick the implementation of each kernel per call: the Triton kernels (or flash_attn) for
CUDA tensors, the pure-torch references otherwise (the CPU path runs only the references).

The kernel mode (``KernelConfig``, set once per process by ``configure_kernels``; until then
from ``MM_SERVE_KERNELS``) overrides the choice: ``auto`` (flash_attn for attention when it can
serve the cache, else Triton, with a step's fresh prefills through torch's FlashAttention-2
varlen kernel), ``triton`` (Triton alone) or ``ref`` (the references everywhere). Triton is
imported only when a CUDA tensor first needs it.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from mm_serve.kernels import varlen_attention as varlen
from mm_serve.kernels.activation import quick_gelu_ref, silu_and_mul_ref
from mm_serve.kernels.attention import paged_attention_ref, reshape_and_cache_ref
from mm_serve.kernels.attention_metadata import AttentionMetadata
from mm_serve.kernels.config import kernel_mode
from mm_serve.kernels.norm import layer_norm_ref, rms_norm_ref
from mm_serve.kernels.rotary import (
    VisionRotary,
    apply_mrotary_ref,
    apply_rotary_ref,
    apply_vision_rotary_ref,
)
from mm_serve.kernels.varlen_attention import Segments

logger = logging.getLogger(__name__)

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_logged: set[str] = set()


def _log_once(message: str, *args: object) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message, *args)


def use_kernels(*tensors: torch.Tensor) -> bool:
    """True when every tensor is on CUDA in fp16/bf16/fp32, the mode is not ``ref`` and Dynamo
    is not tracing (``torch.compile`` traces the references, which Inductor fuses)."""
    if torch.compiler.is_compiling():
        return False
    if not all(t.is_cuda and t.dtype in _KERNEL_DTYPES for t in tensors):
        return False
    return kernel_mode() != "ref"


def _cache_fits(kv_cache: torch.Tensor, dtype: torch.dtype) -> bool:
    """A KV cache the kernels write and read beside ``dtype`` activations: on CUDA, in that
    dtype or FP8 (e4m3)."""
    return kv_cache.is_cuda and kv_cache.dtype in (dtype, torch.float8_e4m3fn)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """KV-cache write; see ``reshape_and_cache_ref``."""
    fits = _cache_fits(kv_cache, key.dtype) and kv_cache.is_contiguous()
    if fits and use_kernels(key, value):
        from mm_serve.kernels.triton_cache import reshape_and_cache_triton

        return reshape_and_cache_triton(key, value, kv_cache, slot_mapping)
    return reshape_and_cache_ref(key, value, kv_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
    key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim], this step's
    value: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim]
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Paged attention; see ``paged_attention_ref``. The backend chosen is logged once.

    With ``key``/``value`` (this step's, already in the cache) and ``metadata.prefill_split``,
    the fresh prefills go through FlashAttention-2's varlen kernel as bundled in torch and the
    other requests through the Triton kernel (``varlen_attention.paged_attention_split``).
    A step with ``metadata.key_end`` (image tokens attending to each other) or a layer with a
    ``sliding_window`` runs the Triton kernel (or the reference), which alone masks both."""
    fits = _cache_fits(kv_cache, query.dtype) and query.shape[-1] <= 256
    if not (fits and use_kernels(query)):
        return paged_attention_ref(query, kv_cache, metadata, scale, sliding_window)
    from mm_serve.kernels.flash_attention import flash_attn_unusable_reason, paged_attention_flash
    from mm_serve.kernels.triton_attention import paged_attention_triton

    masked = metadata.key_end is not None or sliding_window is not None
    reason = "kernel mode triton" if kernel_mode() == "triton" else None
    if masked:
        reason = reason or "bidirectional image tokens or a sliding window"
    reason = reason or flash_attn_unusable_reason(query, kv_cache)
    if reason is None:
        _log_once("Paged attention: flash_attn (flash_attn_varlen_func with block_table).")
        return paged_attention_flash(query, kv_cache, metadata, scale)
    split = metadata.prefill_split is not None and key is not None and not masked
    split = split and kv_cache.dtype == query.dtype  # an FP8 cache: every key read from it
    if split and kernel_mode() == "auto":
        out = _prefill_split_attention(query, key, value, kv_cache, metadata, scale)
        if out is not None:
            return out
    _log_once("Paged attention: Triton kernel (%s).", reason)
    return paged_attention_triton(query, kv_cache, metadata, scale, sliding_window=sliding_window)


def _prefill_split_attention(query, key, value, kv_cache, metadata, scale) -> torch.Tensor | None:
    """``varlen_attention.paged_attention_split`` with the Triton kernel for the requests that
    need the cache; None (the reason logged once) where FlashAttention-2's varlen kernel cannot
    run."""
    from mm_serve.kernels.triton_attention import paged_attention_triton

    why_not = varlen.varlen_unusable_reason(query)
    if why_not is not None:
        _log_once("Prefill attention: Triton kernel (%s).", why_not)
        return None
    _log_once("Prefill attention: FlashAttention-2 varlen (torch's) for fresh prefills.")
    # One launch config for the sub-batch (no split-KV variants to compile while serving):
    # the prefill beside it keeps the GPU busy anyway.
    paged = functools.partial(paged_attention_triton, config={"NUM_SEGMENTS": 1})
    return varlen.paged_attention_split(query, key, value, kv_cache, metadata, scale, paged)


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm, optionally with the residual add; see ``rms_norm_ref``."""
    extra = () if residual is None else (residual,)
    same = residual is None or residual.dtype == x.dtype
    if same and use_kernels(x, weight, *extra):
        from mm_serve.kernels.triton_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def layer_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor | None,  # [hidden]
    bias: torch.Tensor | None,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm, optionally with the residual add; see ``layer_norm_ref``."""
    tensors = (weight, bias) if residual is None else (weight, bias, residual)
    affine = all(t is not None and t.dtype == x.dtype for t in tensors)  # else: the reference
    if affine and use_kernels(x, *tensors):
        from mm_serve.kernels.triton_norm import layer_norm_triton

        return layer_norm_triton(x, weight, bias, eps, residual)
    return layer_norm_ref(x, weight, bias, eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2 * d] -> [..., d]``; see ``silu_and_mul_ref``."""
    if use_kernels(x):
        from mm_serve.kernels.triton_activation import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """Same shape as ``x``; see ``quick_gelu_ref``."""
    if use_kernels(x):
        from mm_serve.kernels.triton_activation import quick_gelu_triton

        return quick_gelu_triton(x)
    return quick_gelu_ref(x)


def apply_rotary(
    positions: torch.Tensor,  # [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads * head_dim] or [..., num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim] or [..., num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]
    head_dim: int,
    kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style RoPE; see ``apply_rotary_ref``. ``kv_write = (value, kv_cache,
    slot_mapping)`` then writes the rotated key and the value to the cache (one kernel)."""
    return apply_mrotary(positions, query, key, cos_sin_cache, head_dim, None, kv_write)


def apply_mrotary(
    positions: torch.Tensor,  # [3, num_tokens] or [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads * head_dim] or [..., num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim] or [..., num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]
    head_dim: int,
    mrope_section: list[int] | None,
    kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    mrope_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal RoPE (plain RoPE for ``[T]`` positions or no ``mrope_section``), Qwen2-VL's
    chunked layout or Qwen3-VL's ``mrope_interleaved`` one; see ``apply_mrotary_ref``, and
    ``apply_rotary`` for ``kv_write``."""
    section = mrope_section if positions.ndim == 2 else None
    extra = () if kv_write is None else (kv_write[0],)
    same = all(t.dtype == query.dtype for t in (key, *extra))
    fused = kv_write is None or (
        kv_write[1].is_contiguous() and _cache_fits(kv_write[1], query.dtype)
    )
    if same and fused and use_kernels(query, key, cos_sin_cache, *extra):
        from mm_serve.kernels.triton_rotary import apply_rotary_triton

        return apply_rotary_triton(
            positions, query, key, cos_sin_cache, head_dim, section, kv_write=kv_write,
            mrope_interleaved=mrope_interleaved,
        )  # fmt: skip
    if section is None:
        query, key = apply_rotary_ref(positions, query, key, cos_sin_cache, head_dim)
    else:
        query, key = apply_mrotary_ref(
            positions, query, key, cos_sin_cache, head_dim, section, mrope_interleaved
        )
    if kv_write is not None:
        value, kv_cache, slot_mapping = kv_write
        head_shape = (key.shape[0], -1, head_dim)
        reshape_and_cache(key.view(head_shape), value.reshape(head_shape), kv_cache, slot_mapping)
    return query, key


def varlen_segments(
    bounds: list[int], device: torch.device, dtype: torch.dtype, dense: bool = True
) -> Segments:
    """The segments ``[bounds[i], bounds[i + 1])`` of a vision tower forward for
    ``varlen_attention``, with ``dtype`` activations on ``device``: for FlashAttention-2's
    varlen kernel (torch's) on CUDA in fp16/bf16, equal segments to cuDNN unless not
    ``dense`` (``make_segments``), else grouped by length for batched SDPA."""
    flash = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    flash = flash and varlen.has_flash_varlen() and kernel_mode() != "ref"
    return varlen.make_segments(bounds, device, flash, dense)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments
) -> torch.Tensor:
    """Bidirectional attention within ``segments`` (``varlen_segments``): ``q, k, v: [N,
    num_heads, head_dim]`` -> ``[N, num_heads, head_dim]``, scale ``head_dim ** -0.5``. The
    packed rows go to cuDNN when the segments are equal (``dense_attention``), else to the
    varlen kernel as they are, or to ``segment_attention_ref``."""
    if segments.dense:
        return varlen.dense_attention(q, k, v, segments.max_len)
    if segments.groups is None:
        return varlen.flash_varlen(q, k, v, segments.cu_seqlens, segments.max_len, causal=False)
    return varlen.segment_attention_ref(q, k, v, segments)


def apply_vision_rotary(
    q: torch.Tensor, k: torch.Tensor, rotary: VisionRotary
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_vision_rotary_ref`` on ``q`` and ``k`` ``[N, num_heads, head_dim]``; on CUDA one
    Triton kernel does both, with the same float32 arithmetic (the tables' halves are equal)."""
    if not use_kernels(q, k, rotary.table):
        cos, sin = rotary.cos, rotary.sin
        return apply_vision_rotary_ref(q, cos, sin), apply_vision_rotary_ref(k, cos, sin)
    from mm_serve.kernels.triton_rotary import apply_rotary_triton

    head_dim = rotary.table.shape[-1]
    return apply_rotary_triton(rotary.positions, q, k, rotary.table, head_dim, round_products=False)


def get_activation(name: str):
    """The activation named by an HF config's ``hidden_act`` (``quick_gelu``, ``gelu``,
    ``gelu_pytorch_tanh``, ``silu``, ``relu``), as transformers' ``ACT2FN`` computes it;
    ``quick_gelu`` dispatches to the one-pass Triton kernel on CUDA. Importing
    ``transformers.activations`` instead would load most of transformers and torch._dynamo
    into the engine process (about 175 MB and 4 s of start-up).

    Raises:
        ValueError: an activation not listed here.
    """
    activations = {
        "quick_gelu": quick_gelu,
        "gelu": F.gelu,
        "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
        "silu": F.silu,
        "relu": F.relu,
    }
    if name not in activations:
        raise ValueError(f"Unsupported activation {name!r}; supported: {sorted(activations)}.")
    return activations[name]
