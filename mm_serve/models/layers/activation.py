"""Gated MLP activation."""

from __future__ import annotations

import torch
from torch import nn

from mm_serve.kernels import silu_and_mul


class SiluAndMul(nn.Module):
    """``[..., 2 * d] -> [..., d]``: ``silu(x[..., :d]) * x[..., d:]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
