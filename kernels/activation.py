"""Pure-torch reference of the gated MLP activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]``: ``[..., 2 * d] -> [..., d]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
