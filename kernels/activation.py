"""Pure-torch reference of the gated MLP activation."""

from __future__ import annotations

from functools import partial

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


def get_activation(name: str):
    """The activation named by an HF config's ``hidden_act`` (``quick_gelu``, ``gelu``,
    ``gelu_pytorch_tanh``, ``silu``, ``relu``), as transformers' ``ACT2FN`` computes it;
    ``quick_gelu`` dispatches to the one-pass Triton kernel on CUDA. Importing
    ``transformers.activations`` instead would load most of transformers and torch._dynamo
    into the engine process (about 175 MB and 4 s of start-up).

    Raises:
        ValueError: an activation not listed here.
    """
    from mm_serve.kernels.dispatch import quick_gelu

    activations = {
        "quick_gelu": quick_gelu,
        "gelu": F.gelu,
        "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
        "silu": F.silu,
        "relu": F.relu,
    }
    if name not in activations:
        raise ValueError(f"Unsupported activation {name!r}; supported: {sorted(activations)}.")
    return activations[name]
