"""Mixture-of-experts pieces of the forward (vLLM's ``fused_moe`` design), in pure torch.

A sparse MoE MLP of ``E`` experts, each a gated MLP of width ``I``, over ``T`` tokens:

1. routing (``topk_softmax``, Llama 4's ``topk_sigmoid``): each token's ``top_k`` experts and
   their weights;
2. the token-to-expert sort with block alignment (``moe_align_block_size``): the ``T * top_k``
   (token, choice) slots grouped by expert, each expert's group padded to a multiple of the
   GEMM's row block, so every row block belongs to one expert;
3. two grouped GEMMs, one per projection, each row block against its expert's weight, with
   SiLU-and-mul after the first;
4. the weighted reduction: each slot's output times its routing weight (or, with
   ``weights_on_input``, Llama 4's, the slot's input row), summed per token.

Weights are stacked over experts in ``F.linear``'s layout, as transformers holds them
(``Qwen3VLMoeTextExperts``) and vLLM's ``w13``/``w2``: ``w13 [E, 2 I, H]`` (each expert's
gate rows, then its up rows) and ``w2 [E, H, I]``.

``dispatch_moe.fused_experts`` runs steps 2-4 with the Triton grouped GEMM (``triton_moe``) for
CUDA tensors and with ``fused_experts_ref`` (the same block layout, in torch) otherwise;
``fused_experts_loop_ref`` is the plain per-expert loop in float32 that tests compare both
with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mm_serve.kernels.activation import silu_and_mul_ref


def topk_softmax(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: ``(topk_weights float32 [T, top_k], topk_ids int32 [T, top_k])``, the
    ``top_k`` largest probabilities of a float32 softmax over the experts, highest first, and
    their experts; ``renormalize`` divides each token's weights by their sum (the checkpoint's
    ``norm_topk_prob``; always so for Qwen3-VL-MoE, HF ``Qwen3VLMoeTextTopKRouter``)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def topk_sigmoid(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's routing (HF ``Llama4Router``): the ``top_k`` largest logits' experts (int32
    ``[T, top_k]``) and the sigmoid of those logits as weights (float32 ``[T, top_k]``), which
    scale the experts' inputs (``weights_on_input``)."""
    logits, ids = router_logits.topk(top_k, dim=-1)
    return torch.sigmoid(logits.float()), ids.to(torch.int32)


@dataclass(frozen=True)
class ExpertBlocks:
    """The (token, choice) slots sorted by expert and padded per expert to ``block_size`` rows
    (vLLM's ``moe_align_block_size``). A slot is ``token * top_k + j`` (row of the flattened
    ``topk_ids``); padding rows hold ``T * top_k``, a slot that does not exist.

    Sizes are fixed by ``T``, ``top_k``, ``E`` and ``block_size`` alone (nothing read back from
    the device): ``sorted_token_ids`` has room for the most padding any routing can need."""

    sorted_token_ids: torch.Tensor  # [num_blocks * block_size] int32
    expert_ids: torch.Tensor  # [num_blocks] int32: the expert of each block, -1 past the end
    num_tokens_post_padded: torch.Tensor  # [1] int32: the rows in use (whole blocks)
    block_size: int


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> ExpertBlocks:
    """``topk_ids`` ``[T, top_k]`` -> ``ExpertBlocks``: expert ``e``'s slots (in slot order)
    fill rows ``[start_e, start_e + count_e)`` of its ``ceil(count_e / block_size)`` blocks,
    the experts in order; an expert no slot chose has no block."""
    flat = topk_ids.flatten().long()
    num_slots = flat.numel()
    # scatter_add_, not bincount: bincount's output size is read back from the device.
    counts = flat.new_zeros(num_experts).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_size - 1) // block_size * block_size
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)  # slots grouped by expert, in slot order within
    expert_of = flat[order]
    first_of_expert = counts.cumsum(0) - counts  # in ``order``
    rank = torch.arange(num_slots, device=flat.device) - first_of_expert[expert_of]
    max_rows = num_slots + num_experts * (block_size - 1)
    num_blocks = -(-max_rows // block_size)
    sorted_ids = flat.new_full((num_blocks * block_size,), num_slots)
    sorted_ids[ends[expert_of] - padded[expert_of] + rank] = order
    block_starts = torch.arange(num_blocks, device=flat.device) * block_size
    expert_ids = torch.searchsorted(ends, block_starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1)
    return ExpertBlocks(
        sorted_ids.to(torch.int32),
        expert_ids.to(torch.int32),
        ends[-1:].to(torch.int32),
        block_size,
    )


def fused_experts_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, top_k] float32
    topk_ids: torch.Tensor,  # [T, top_k] int32
    weights_on_input: bool = False,
    block_size: int = 16,
) -> torch.Tensor:
    """The experts' outputs summed with their routing weights, ``[T, H]`` in ``x``'s dtype: the
    Triton kernel's computation in torch, over ``moe_align_block_size``'s blocks (each run of
    blocks of one expert is one GEMM per projection against that expert's weight; padding rows
    are computed and dropped). ``weights_on_input``: a slot's weight scales its input row
    (rounded to ``x``'s dtype, as HF's ``Llama4TextMoe``), not its output. Reads the blocks'
    experts back to the host."""
    num_tokens, top_k = topk_ids.shape
    blocks = moe_align_block_size(topk_ids, block_size, w13.shape[0])
    used = int(blocks.num_tokens_post_padded) // block_size
    experts, runs = blocks.expert_ids[:used].unique_consecutive(return_counts=True)
    num_slots = num_tokens * top_k
    slots = blocks.sorted_token_ids[: used * block_size].long()
    real = slots < num_slots
    slots = torch.where(real, slots, 0)  # padding rows compute slot 0's row, then are dropped
    weights = topk_weights.flatten()[slots].unsqueeze(-1)  # [rows, 1]
    rows = x[slots // top_k]
    if weights_on_input:
        rows = (rows * weights).to(x.dtype)
    sizes = (runs * block_size).tolist()  # rows of each run of one expert's blocks
    pieces = [
        silu_and_mul_ref(part @ w13[expert].T) @ w2[expert].T  # [rows, H]
        for expert, part in zip(experts.tolist(), rows.split(sizes), strict=True)
    ]
    out = torch.cat(pieces) if pieces else x.new_zeros(0, x.shape[1])
    if not weights_on_input:
        out = out * weights
    per_slot = out.new_zeros(num_slots, x.shape[1])
    per_slot[slots[real]] = out[real]
    return per_slot.view(num_tokens, top_k, x.shape[1]).sum(dim=1).to(x.dtype)


def fused_experts_loop_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, top_k]
    topk_ids: torch.Tensor,  # [T, top_k]
    weights_on_input: bool = False,
) -> torch.Tensor:
    """``fused_experts_ref``'s result by the plain loop over experts (HF's
    ``Qwen3VLMoeTextExperts.forward``), in float32: ``[T, H]`` float32."""
    x, out = x.float(), x.new_zeros(x.shape, dtype=torch.float32)
    for expert in range(w13.shape[0]):
        token, choice = (topk_ids == expert).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        weight = topk_weights[token, choice, None].float()
        rows = x[token] * weight if weights_on_input else x[token]
        hidden = silu_and_mul_ref(rows @ w13[expert].float().T) @ w2[expert].float().T
        out.index_add_(0, token, hidden if weights_on_input else hidden * weight)
    return out
