"""Batched LoRA over a batch that mixes adapters (punica's shrink and expand).

Every token has an adapter slot ``indices[t]`` (``-1``: the base model alone). Slot ``l``
holds ``A [max_loras, R, K]`` and ``B [max_loras, N, R]`` (ranks padded to ``R`` with zeros):

- shrink: ``out[t] = scale * A[indices[t]] @ x[t]`` (zeros where ``indices[t] < 0``);
- expand: ``y[t, offset : offset + N] += B[indices[t]] @ buf[t]`` (``y`` untouched where
  ``indices[t] < 0``), in place.

``lora_shrink``/``lora_expand`` dispatch (``kernels.dispatch.use_kernels``) to the Triton
kernels (``triton_lora``) for CUDA tensors and to the references here otherwise. The references
run one matmul per adapter present (the rows of each slot gathered: SGMV's grouping); the Triton
kernels one program per token and output tile (BGMV).
"""

from __future__ import annotations

import torch

from mm_serve.kernels.dispatch import use_kernels


def lora_shrink_ref(
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [max_loras, R, K]
    indices: torch.Tensor,  # [T] int, -1: no adapter
    scale: float = 1.0,
) -> torch.Tensor:
    """``[T, R]`` in ``x``'s dtype, float32 accumulation: ``scale * x[t] @ A[indices[t]].T``,
    zero rows for tokens without an adapter."""
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for slot in indices.unique().tolist():
        if slot < 0:
            continue
        rows = indices == slot
        out[rows] = x[rows].float() @ lora_a[slot].float().T
    return (out * scale).to(x.dtype)


def lora_expand_ref(
    buf: torch.Tensor,  # [T, R], lora_shrink's output
    lora_b: torch.Tensor,  # [max_loras, N, R]
    indices: torch.Tensor,  # [T] int, -1: no adapter
    y: torch.Tensor,  # [T, >= offset + N], updated in place
    offset: int = 0,
) -> None:
    """``y[t, offset : offset + N] += buf[t] @ B[indices[t]].T`` for tokens with an adapter
    (float32 products, rounded once into ``y``'s dtype)."""
    n = lora_b.shape[1]
    for slot in indices.unique().tolist():
        if slot < 0:
            continue
        rows = indices == slot
        delta = buf[rows].float() @ lora_b[slot].float().T
        y[rows, offset : offset + n] = (y[rows, offset : offset + n].float() + delta).to(y.dtype)


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, indices: torch.Tensor, scale: float = 1.0
) -> torch.Tensor:
    """See ``lora_shrink_ref``; the Triton kernel for CUDA tensors."""
    if use_kernels(x, lora_a) and x.stride(-1) == 1 and lora_a.is_contiguous():
        from mm_serve.kernels.triton_lora import lora_shrink_triton

        return lora_shrink_triton(x, lora_a, indices, scale)
    return lora_shrink_ref(x, lora_a, indices, scale)


def lora_expand(
    buf: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor, y: torch.Tensor, offset: int = 0
) -> None:
    """See ``lora_expand_ref``; the Triton kernel for CUDA tensors."""
    if use_kernels(buf, lora_b, y) and y.stride(-1) == 1 and lora_b.stride(-1) == 1:
        from mm_serve.kernels.triton_lora import lora_expand_triton

        return lora_expand_triton(buf, lora_b, indices, y, offset)
    return lora_expand_ref(buf, lora_b, indices, y, offset)
