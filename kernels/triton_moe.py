"""Triton grouped GEMM of the mixture-of-experts MLP (vLLM's ``fused_moe_kernel``): the GPU
counterpart of ``moe.fused_experts_ref``.

The slots are sorted by expert and padded per expert to ``BLOCK_M`` rows
(``moe.moe_align_block_size``), so each program's row block reads one expert's weight. Two
launches of one kernel:

1. ``GATED``: rows gathered from ``x`` (slot // top_k), against the expert's gate and up rows
   of ``w13`` in one pass (two accumulators), ``silu(gate) * up`` written per slot
   (``[T * top_k, I]``), rounded as ``silu_and_mul_triton``;
2. those rows against ``w2``, written per slot (``[T * top_k, H]``); the launcher sums each
   token's ``top_k`` rows.

``MUL_ROUTED_WEIGHT`` scales a launch's accumulators by the slot's routing weight: the second
launch's (the output weighted), or with the weight on the input (Llama 4) the first's, before
the activation (``(w x) W = w (x W)``).

Blocks past ``num_tokens_post_padded`` return at once; padding rows are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mm_serve.kernels.moe import ExpertBlocks, moe_align_block_size
from mm_serve.kernels.triton_gemm import tile_offsets


@triton.jit
def _fused_moe_kernel(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr,
    num_tokens_post_padded_ptr, N, K, num_rows, num_slots,
    stride_am, stride_be, stride_bn, stride_cm,
    TOP_K: tl.constexpr, GATED: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """``c[slot, :N] = act(a[slot // TOP_K] @ b[expert].T)`` for the slots of one row block;
    ``b`` is ``[E, N, K]`` (``[E, 2 N, K]`` when ``GATED``: gate rows, then up rows), ``a``,
    ``b`` and ``c`` contiguous along K and N. ``PRECISION``: ``tl.dot``'s input precision
    ("ieee" keeps float32 operands float32, where TF32 would round them)."""
    num_pid_m, num_pid_n = tl.cdiv(num_rows, BLOCK_M), tl.cdiv(N, BLOCK_N)
    off_m, off_n = tile_offsets(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M, BLOCK_M, BLOCK_N)
    if off_m >= tl.load(num_tokens_post_padded_ptr):
        return
    slots = tl.load(sorted_token_ids_ptr + off_m + tl.arange(0, BLOCK_M))
    real = slots < num_slots
    expert = tl.load(expert_ids_ptr + off_m // BLOCK_M).to(tl.int64)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (slots // TOP_K).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_in = offs_k < K - k
        a = tl.load(a_ptrs, mask=real[:, None] & k_in[None, :], other=0.0)
        b_mask = k_in[:, None] & (offs_n < N)[None, :]
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GATED:  # the up rows are N rows below the gate rows
            b_up = tl.load(b_ptrs + N * stride_bn, mask=b_mask, other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + slots, mask=real, other=0.0)[:, None]
        acc, acc_up = acc * weight, acc_up * weight
    dtype = c_ptr.dtype.element_ty
    y = acc.to(dtype).to(tl.float32)  # rounded as the reference's GEMM output
    if GATED:  # silu_and_mul_triton's roundings
        y = (y / (1.0 + tl.exp(-y))).to(dtype).to(tl.float32) * acc_up.to(dtype).to(tl.float32)
    c_ptrs = c_ptr + slots.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, y.to(dtype), mask=real[:, None] & (offs_n < N)[None, :])


def moe_config(num_slots: int, num_experts: int) -> dict[str, int]:
    """Tile sizes by the slots per expert (vLLM's untuned default): 16-row blocks when an
    expert gets about one slot (decode), 64-row blocks otherwise."""
    if num_slots <= num_experts:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4}


def _grouped_gemm(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor,
    blocks: ExpertBlocks, top_k: int, gated: bool, weighted: bool, config: dict[str, int],
) -> None:  # fmt: skip
    """One launch of ``_fused_moe_kernel`` writing ``c`` ``[num_slots, N]``."""
    n, k = c.shape[1], a.shape[1]
    num_rows = blocks.sorted_token_ids.numel()
    grid = (triton.cdiv(num_rows, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
    _fused_moe_kernel[grid](
        a, b, c, topk_weights, blocks.sorted_token_ids, blocks.expert_ids,
        blocks.num_tokens_post_padded, n, k, num_rows, c.shape[0],
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        TOP_K=top_k, GATED=gated, MUL_ROUTED_WEIGHT=weighted,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", **config,
    )  # fmt: skip


def fused_experts_triton(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, weights_on_input: bool = False, config: dict[str, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """``[T, H]`` in ``x``'s dtype, as ``moe.fused_experts_ref`` (same shapes: ``x [T, H]``,
    ``w13 [E, 2 I, H]``, ``w2 [E, H, I]``, float32 ``topk_weights`` and int ``topk_ids``
    ``[T, top_k]``, ``weights_on_input``); ``x``, ``w13`` and ``w2`` of one dtype.
    ``config``: ``moe_config``'s keys."""
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    config = config or moe_config(num_tokens * top_k, num_experts)
    blocks = moe_align_block_size(topk_ids, config["BLOCK_M"], num_experts)
    weights = topk_weights.float().contiguous()
    x, w13, w2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, w13, w2))
    hidden = x.new_empty(num_tokens * top_k, inter)
    _grouped_gemm(x, w13, hidden, weights, blocks, top_k, True, weights_on_input, config)
    out = x.new_empty(num_tokens * top_k, x.shape[1])
    _grouped_gemm(hidden, w2, out, weights, blocks, 1, False, not weights_on_input, config)
    return out.view(num_tokens, top_k, x.shape[1]).sum(dim=1)
