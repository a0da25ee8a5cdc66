"""RMSNorm and LayerNorm with the residual add fused in (vLLM's calling convention)."""

from __future__ import annotations

import torch
from torch import nn

from mm_serve.kernels import layer_norm, rms_norm, rms_norm_linear


class RMSNorm(nn.Module):
    """``forward(x) -> normed`` or ``forward(x, residual) -> (normed(x + residual), x + residual)``,
    all ``[..., hidden_size]``; numerics of HF ``LlamaRMSNorm`` (see ``rms_norm_ref``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)


class LayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` (same parameters, ``weight`` and ``bias``) with RMSNorm's calling
    convention: ``forward(x) -> normed`` or ``forward(x, residual) -> (normed(x + residual),
    x + residual)``, all ``[..., normalized_shape]``; see ``layer_norm_ref``."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return layer_norm(x, self.weight, self.bias, self.eps, residual)


def rms_norm_then_linear(
    norm: RMSNorm, linear: nn.Module, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(norm(x + residual)), x + residual)`` (``x`` alone when ``residual`` is None)
    for a column-parallel ``linear`` (no all-reduce): one kernel for one token (two for a
    quantized ``linear``)."""
    if getattr(linear, "quant_method", None) is not None:
        if residual is None:
            return linear(norm(x)), x
        normed, residual = norm(x, residual)
        return linear(normed), residual
    return rms_norm_linear(x, residual, norm.weight, norm.eps, linear.weight, linear.bias)
