"""The fused MoE's kernel choice per call: the Triton grouped GEMMs (``triton_moe``) for CUDA
tensors, ``moe.fused_experts_ref`` otherwise; on CUDA under ``torch.compile`` the opaque
``mm_serve::fused_experts``."""

from __future__ import annotations

import torch

from mm_serve.kernels.dispatch import kernel_mode, use_kernels
from mm_serve.kernels.moe import fused_experts_ref


def fused_experts(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, top_k] float32
    topk_ids: torch.Tensor,  # [T, top_k] int32
    weights_on_input: bool = False,
) -> torch.Tensor:
    """``[T, H]``, see ``fused_experts_ref``: the Triton grouped GEMMs (``triton_moe``) for
    CUDA tensors of one dtype (nothing read back: CUDA graphs capture them), else the
    reference. Under ``torch.compile`` on CUDA it is the
    opaque ``mm_serve::fused_experts`` (the kernel's launch sizes depend on the routing)."""
    args = (x, w13, w2, topk_weights, topk_ids, weights_on_input)
    if torch.compiler.is_compiling() and x.is_cuda and kernel_mode() != "ref":
        return torch.ops.mm_serve.fused_experts(*args)
    same = w13.dtype == w2.dtype == x.dtype
    if same and x.shape[0] > 0 and use_kernels(x, w13, w2):
        from mm_serve.kernels.triton_moe import fused_experts_triton

        return fused_experts_triton(*args)
    return fused_experts_ref(*args)


@torch.library.custom_op("mm_serve::fused_experts", mutates_args=())
def _fused_experts_op(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    weights_on_input: bool,
) -> torch.Tensor:
    return fused_experts(x, w13, w2, topk_weights, topk_ids, weights_on_input)


@_fused_experts_op.register_fake
def _(x, w13, w2, topk_weights, topk_ids, weights_on_input):
    return torch.empty_like(x)
