"""Pure-torch reference of rotary position embedding (NeoX style, as HF Llama/Qwen2)."""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_ref(
    positions: torch.Tensor,  # [num_tokens] int
    query: torch.Tensor,  # [num_tokens, num_heads * head_dim] or [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim] or [..., num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos | sin, each head_dim // 2
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` and ``key`` by their positions; returns new tensors of the same shapes.

    ``x * cos + rotate_half(x) * sin`` with the half-frequency table repeated over both halves
    (HF ``apply_rotary_pos_emb``); cos/sin are cast to the input dtype first, as HF does.
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [num_tokens, head_dim // 2]
    cos = torch.cat((cos, cos), dim=-1)[:, None, :].to(query.dtype)
    sin = torch.cat((sin, sin), dim=-1)[:, None, :].to(query.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(x.shape[0], -1, head_dim)
        return (h * cos + _rotate_half(h) * sin).reshape(x.shape)

    return rotate(query), rotate(key)
