"""Triton rotary position embedding (NeoX style), plain and multimodal (M-RoPE: Qwen2-VL's
chunked layout, Qwen3-VL's interleaved one).

The GPU counterpart of ``apply_rotary_ref`` and ``apply_mrotary_ref``. RoPE: Su et al.,
"RoFormer", arXiv:2104.09864; the half-split ("rotate_half") layout of GPT-NeoX / HF Llama;
M-RoPE: Qwen2-VL, arXiv:2409.12191, section 2.1. For inputs in fp16/bf16 every product and sum
is rounded to the input dtype as the reference's torch ops do, and FP fusion is off for this
kernel (an FMA would skip a rounding), so the results equal the reference's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mm_serve.kernels.pdl import pdl_enter, pdl_options


@triton.jit
def _rotate_heads(
    out_ptr, x_ptr, token, stride_x_tok, stride_x_head, stride_o_tok, num_heads, cos, sin,
    cache_ptr, slot, stride_c_slot,
    HALF: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr, ROUND: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
):  # fmt: skip
    """``out = x * cos + rotate_half(x) * sin`` for all heads of one token; with
    ``WRITE_CACHE`` also into the cache slot ``slot`` (none when it is negative)."""
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_i = tl.arange(0, HALF_PAD)[None, :]
    mask = (offs_h < num_heads) & (offs_i < HALF)
    src = x_ptr + token * stride_x_tok + offs_h * stride_x_head + offs_i
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    a1, b1 = x1 * cos, x2 * sin
    a2, b2 = x2 * cos, x1 * sin
    if ROUND:  # each product rounded to the input dtype, as in the reference
        dtype = out_ptr.dtype.element_ty
        a1, b1 = a1.to(dtype).to(tl.float32), b1.to(dtype).to(tl.float32)
        a2, b2 = a2.to(dtype).to(tl.float32), b2.to(dtype).to(tl.float32)
    dst = out_ptr + token * stride_o_tok + offs_h * (2 * HALF) + offs_i
    y1, y2 = (a1 - b1).to(out_ptr.dtype.element_ty), (a2 + b2).to(out_ptr.dtype.element_ty)
    tl.store(dst, y1, mask=mask)
    tl.store(dst + HALF, y2, mask=mask)
    if WRITE_CACHE:
        _store_slot(cache_ptr, slot, stride_c_slot, y1, y2, offs_h, offs_i, mask, HALF)


@triton.jit
def _store_slot(cache_ptr, slot, stride_c_slot, x1, x2, offs_h, offs_i, mask, HALF: tl.constexpr):
    """Both halves of every KV head of one token into cache slot ``slot`` (skipped if < 0)."""
    if slot >= 0:
        dst = cache_ptr + slot * stride_c_slot + offs_h * (2 * HALF) + offs_i
        tl.store(dst, x1.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, x2.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["stride_pos_axis"])  # per-step values: no compiles mid-serving
def _rotary_kernel(
    q_out_ptr, k_out_ptr, q_ptr, k_ptr, positions_ptr, cos_sin_ptr,
    stride_pos_axis, stride_cs, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
    stride_qo_tok, stride_ko_tok, num_heads, num_kv_heads,
    v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, stride_v_tok, stride_v_head, stride_c_slot,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr, MROPE: tl.constexpr, INTERLEAVED: tl.constexpr,
    SECTION_0: tl.constexpr, SECTION_1: tl.constexpr, SECTION_2: tl.constexpr,
    ROUND: tl.constexpr, WRITE_CACHE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    offs_i = tl.arange(0, HALF_PAD)
    i_ok = offs_i < HALF
    if MROPE:  # frequency i takes its position from axis 0 (t), 1 (h) or 2 (w): mrope_axes
        if INTERLEAVED:  # t h w t h w ...: axis i % 3 while it has frequencies left
            rem = offs_i % 3
            axis = tl.where((rem == 1) & (offs_i < 3 * SECTION_1), 1, 0)
            axis = tl.where((rem == 2) & (offs_i < 3 * SECTION_2), 2, axis)
        else:
            axis = tl.where(offs_i < SECTION_0, 0, tl.where(offs_i < SECTION_0 + SECTION_1, 1, 2))
        pos = tl.load(positions_ptr + axis * stride_pos_axis + token, mask=i_ok, other=0)
    else:
        pos = tl.load(positions_ptr + token + offs_i * 0)
    row = cos_sin_ptr + pos.to(tl.int64) * stride_cs
    cos = tl.load(row + offs_i, mask=i_ok, other=0.0)
    sin = tl.load(row + HALF + offs_i, mask=i_ok, other=0.0)
    if ROUND:  # the table is cast to the input dtype first
        dtype = q_out_ptr.dtype.element_ty
        cos, sin = cos.to(dtype).to(tl.float32), sin.to(dtype).to(tl.float32)
    cos, sin = cos[None, :], sin[None, :]
    slot = -1
    if WRITE_CACHE:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    pdl_enter(USE_PDL)  # positions and slots come from host copies; q, k, v from a kernel
    _rotate_heads(
        q_out_ptr, q_ptr, token, stride_q_tok, stride_q_head, stride_qo_tok, num_heads, cos, sin,
        q_out_ptr, slot, 0, HALF, Q_HEADS_PAD, HALF_PAD, ROUND, False,
    )  # fmt: skip
    _rotate_heads(
        k_out_ptr, k_ptr, token, stride_k_tok, stride_k_head, stride_ko_tok, num_kv_heads, cos,
        sin, k_cache_ptr, slot, stride_c_slot, HALF, K_HEADS_PAD, HALF_PAD, ROUND, WRITE_CACHE,
    )  # fmt: skip
    if WRITE_CACHE:  # V unrotated
        offs_h = tl.arange(0, K_HEADS_PAD)[:, None]
        mask = (offs_h < num_kv_heads) & i_ok[None, :]
        src = v_ptr + token * stride_v_tok + offs_h * stride_v_head + offs_i[None, :]
        v1 = tl.load(src, mask=mask, other=0.0)
        v2 = tl.load(src + HALF, mask=mask, other=0.0)
        _store_slot(v_cache_ptr, slot, stride_c_slot, v1, v2, offs_h, offs_i[None, :], mask, HALF)


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    h = x.reshape(x.shape[0], -1, head_dim)
    return h if h.stride(-1) == 1 else h.contiguous()


def _cache_operands(
    kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kv_write``'s (value ``[T, num_kv_heads, head_dim]``, kv_cache, slot_mapping); without
    ``kv_write``, stand-ins the kernel does not read. ``ValueError`` for a strided kv_cache."""
    if kv_write is None:
        return k, k[None], positions
    value, kv_cache, slot_mapping = kv_write
    if not kv_cache.is_contiguous():
        raise ValueError("apply_rotary_triton: kv_write needs a contiguous kv_cache.")
    return _heads(value, head_dim), kv_cache, slot_mapping


def _sections(mrope_section: list[int] | None, head_dim: int) -> list[int]:
    """The ``[t, h, w]`` frequency split (plain RoPE: all in ``t``); ``ValueError`` unless it
    has 3 parts summing to ``head_dim // 2``."""
    if mrope_section is None:
        return [head_dim // 2, 0, 0]
    if len(mrope_section) != 3 or sum(mrope_section) != head_dim // 2:
        raise ValueError(
            f"mrope_section {mrope_section} must be 3 parts summing to {head_dim // 2}"
        )
    return mrope_section


def apply_rotary_triton(
    positions: torch.Tensor,  # [num_tokens] int, or [3, num_tokens] with mrope_section
    query: torch.Tensor,  # [num_tokens, num_heads * head_dim] or [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim] or [..., num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32: cos | sin
    head_dim: int,
    mrope_section: list[int] | None = None,  # [t, h, w] frequencies, summing to head_dim // 2
    out: tuple[torch.Tensor, torch.Tensor] | None = None,  # (query, key) shapes, written
    round_products: bool | None = None,
    kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    mrope_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` and ``key`` by their positions; returns new tensors of their shapes.

    Contract of ``apply_rotary_ref`` (``positions [T]``) and, with ``mrope_section`` and
    ``positions [3, T]``, of ``apply_mrotary_ref`` (``mrope_interleaved``: Qwen3-VL's
    layout, see ``rotary.mrope_axes``). ``query`` and ``key`` share one dtype and
    may be strided views (e.g. slices of a fused QKV output) with a contiguous last dim.
    ``round_products`` (default: for fp16/bf16 inputs) rounds the table and every product to
    the input dtype, as the references' torch ops do; False computes in float32 and rounds
    only the result (HF's vision rotary, ``apply_rotary_pos_emb_vision``).
    ``kv_write = (value, kv_cache, slot_mapping)`` also writes the rotated key and ``value``
    (``[T, num_kv_heads(*head_dim)]``) into the contiguous ``kv_cache`` ``[2, num_blocks,
    block_size, num_kv_heads, head_dim]`` at ``slot_mapping`` (``[T]`` int64; negative slots
    skipped): ``reshape_and_cache`` fused in, one kernel for RoPE and the KV write.
    Raises ``ValueError`` for an mrope_section that does not sum to ``head_dim // 2`` or a
    strided ``kv_cache``.
    """
    num_tokens = query.shape[0]
    q, k = _heads(query, head_dim), _heads(key, head_dim)
    positions = positions if positions.stride(-1) == 1 else positions.contiguous()
    if out is None:
        out = (torch.empty_like(query), torch.empty_like(key))
    q_out, k_out = out[0].view(num_tokens, -1, head_dim), out[1].view(num_tokens, -1, head_dim)
    mrope, sections = mrope_section is not None, _sections(mrope_section, head_dim)
    if num_tokens == 0:
        return out
    half = head_dim // 2
    v, kv_cache, slot_mapping = _cache_operands(kv_write, k, positions, head_dim)
    _rotary_kernel[(num_tokens,)](
        q_out, k_out, q, k, positions, cos_sin_cache,
        positions.stride(0) if mrope else 0, cos_sin_cache.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), k_out.stride(0),
        q.shape[1], k.shape[1],
        v, kv_cache[0], kv_cache[-1], slot_mapping, v.stride(0), v.stride(1),
        k.shape[1] * head_dim,
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
        Q_HEADS_PAD=triton.next_power_of_2(q.shape[1]),
        K_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
        MROPE=mrope, INTERLEAVED=mrope and mrope_interleaved,
        SECTION_0=sections[0], SECTION_1=sections[1], SECTION_2=sections[2],
        ROUND=query.dtype != torch.float32 if round_products is None else round_products,
        WRITE_CACHE=kv_write is not None,
        num_warps=4 if q.shape[1] * half >= 1024 else 1,
        enable_fp_fusion=False,  # an FMA would skip the reference's rounding of each product
        **pdl_options(query.device),
    )  # fmt: skip
    return out
