"""Pure-torch reference of RMSNorm, optionally fused with the residual add."""

from __future__ import annotations

import torch


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
