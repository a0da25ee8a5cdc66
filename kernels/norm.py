"""Pure-torch references of RMSNorm and LayerNorm, each optionally fused with the residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * x / rms(x)``, normalised in float32 and cast back, as HF's LlamaRMSNorm.

    With ``residual``: first ``x = x + residual`` in the input dtype (HF adds the residual
    in the model dtype), then returns ``(rms_norm(x), x)``; the second is the next residual.
    """
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, residual)


def layer_norm_ref(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor | None,  # [hidden]
    bias: torch.Tensor | None,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``torch.nn.LayerNorm`` over the last dim. With ``residual``: first ``x = x + residual``
    in the input dtype (a pre-norm block's residual add), then returns ``(layer_norm(x), x)``;
    the second is the next residual."""
    if residual is not None:
        x = x + residual
        residual = x
    out = F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return out if residual is None else (out, residual)
