"""Pure-torch references of the linear layers' products."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mm_serve.kernels.activation import silu_and_mul_ref
from mm_serve.kernels.norm import rms_norm_ref


def linear_ref(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """``x @ weight.T + bias`` -> ``[..., N]`` (``F.linear``)."""
    return F.linear(x, weight, bias)


def silu_and_mul_linear_ref(
    x: torch.Tensor,  # [..., 2 * K]: gate | up
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """``linear(silu(gate) * up)`` -> ``[..., N]``: the gated MLP's activation and down
    projection."""
    return F.linear(silu_and_mul_ref(x), weight, bias)


def rms_norm_linear_ref(
    x: torch.Tensor,  # [..., K]
    residual: torch.Tensor | None,  # [..., K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm linear: ``(linear(rms_norm(h)), h)`` with ``h = x + residual`` (``x`` when
    ``residual`` is None)."""
    if residual is None:
        return F.linear(rms_norm_ref(x, norm_weight, eps), weight, bias), x
    normed, h = rms_norm_ref(x, norm_weight, eps, residual)
    return F.linear(normed, weight, bias), h
