"""Pure-torch reference of the gated MLP activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]``: ``[..., 2 * d] -> [..., d]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def quick_gelu_ref(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 * x)``, same shape (HF ``QuickGELUActivation``; the sigmoid
    approximation of GELU from Hendrycks & Gimpel 2016, arXiv:1606.08415)."""
    return x * torch.sigmoid(1.702 * x)
