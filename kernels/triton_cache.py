"""Triton KV-cache write: the GPU counterpart of ``reshape_and_cache_ref`` (vLLM's
``reshape_and_cache``): token ``t``'s K and V go to flat slot ``slot_mapping[t]``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mm_serve.kernels.pdl import pdl_enter, pdl_options


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_slot,  # elements between consecutive slots (num_kv_heads * head_dim)
    stride_c_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # from a host copy: before the wait
    if slot < 0:  # padding token: nothing to write
        return
    pdl_enter(USE_PDL)
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_k_tok + offs_h * stride_k_head + offs_d, mask=mask)
    v = tl.load(value_ptr + token * stride_v_tok + offs_h * stride_v_head + offs_d, mask=mask)
    dst = slot * stride_c_slot + offs_h * stride_c_head + offs_d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_slots] int64, block_id * block_size + offset
) -> None:
    """Write each token's K/V into its flat slot of ``kv_cache`` (in place).

    Same contract as ``reshape_and_cache_ref``: rows past ``len(slot_mapping)`` and slots < 0
    are skipped; values are cast to the cache dtype. ``key``/``value`` may be strided views
    (e.g. slices of a fused QKV output) as long as the last dim is contiguous; ``kv_cache`` must
    be contiguous. Raises ``ValueError`` for a non-contiguous cache.
    """
    num_slots = slot_mapping.numel()
    if num_slots == 0:
        return
    if not kv_cache.is_contiguous():
        raise ValueError("reshape_and_cache_triton needs a contiguous kv_cache (written in place).")
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(num_slots,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        **pdl_options(key.device),
    )
