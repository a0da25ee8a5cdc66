"""Pure-torch references of rotary position embedding (NeoX style, as HF Llama/Qwen2), and
of the Qwen2-VL vision tower's 2-D rotary in float32."""

from __future__ import annotations

from dataclasses import dataclass

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


def mrope_axes(mrope_section: list[int], half: int, interleaved: bool = False) -> list[int]:
    """The position axis (0: t, 1: h, 2: w) of each of the ``half = head_dim // 2`` rotary
    frequencies.

    Chunked (Qwen2-VL, arXiv:2409.12191, section 2.1): ``mrope_section[0]`` frequencies of t,
    then of h, then of w. Interleaved (Qwen3-VL, HF ``Qwen3VLTextRotaryEmbedding``'s
    ``recomposition_frequencies``): t h w t h w ...; frequency ``i`` takes axis ``i % 3`` while
    that axis has frequencies left (h: ``i < 3 * mrope_section[1]``, w: ``i < 3 *
    mrope_section[2]``), else t.
    """
    if not interleaved:
        return [axis for axis, n in enumerate(mrope_section) for _ in range(n)]
    bounds = (0, 3 * mrope_section[1], 3 * mrope_section[2])
    return [i % 3 if i % 3 and i < bounds[i % 3] else 0 for i in range(half)]


def apply_mrotary_ref(
    positions: torch.Tensor,  # [3, num_tokens] int (t, h, w), or [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads * head_dim] or [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim] or [..., num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos | sin, each head_dim // 2
    head_dim: int,
    mrope_section: list[int],  # 3 parts summing to head_dim // 2
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal RoPE (Qwen2-VL, arXiv:2409.12191, section 2.1); returns new tensors.

    Rotary frequency ``i`` rotates by the token's position on axis ``mrope_axes(...)[i]``
    (``mrope_section`` splits the ``head_dim // 2`` frequencies into t, h, w parts, chunked or
    ``interleaved``); the cos and sin halves are picked alike (HF ``Qwen2VLRotaryEmbedding``
    and ``Qwen3VLTextRotaryEmbedding`` recomposition). ``[T]`` positions (all axes equal:
    text, decode) is plain :func:`apply_rotary_ref`.
    """
    if positions.ndim == 1:
        return apply_rotary_ref(positions, query, key, cos_sin_cache, head_dim)
    half = head_dim // 2
    axes = mrope_axes(mrope_section, half, interleaved)
    axis = torch.tensor(axes * 2, device=positions.device)  # cos half, then sin half
    # [T, head_dim]: entry j of token t from the table row of its position on axis[j].
    table = cos_sin_cache[positions[axis].T, torch.arange(head_dim, device=positions.device)]
    # Each token now has its own row of the table: rotate token t by row t.
    rows = torch.arange(table.shape[0], device=table.device)
    return apply_rotary_ref(rows, query, key, table, head_dim)


def apply_vision_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [N, num_heads, head_dim]`` by ``cos/sin: [N, head_dim]``, in float32 and cast
    back to ``x.dtype`` (HF ``apply_rotary_pos_emb_vision``)."""
    xf = x.float()
    return (xf * cos[:, None] + _rotate_half(xf) * sin[:, None]).to(x.dtype)


@dataclass(frozen=True)
class VisionRotary:
    """One tower forward's 2-D rotary tables, built once (``vision_rotary``) for all blocks.

    ``cos, sin``: ``[N, head_dim]`` float32; ``table``: ``[N, head_dim]`` float32, the cos and
    sin of the ``head_dim // 2`` distinct angles side by side (the Triton kernel's layout);
    ``positions``: ``[N]`` int64, row ``i`` reads table row ``i``.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    table: torch.Tensor
    positions: torch.Tensor


def vision_rotary(cos: torch.Tensor, sin: torch.Tensor) -> VisionRotary:
    """The ``VisionRotary`` of ``[N, head_dim]`` tables whose halves are equal."""
    half = cos.shape[-1] // 2
    table = torch.cat([cos[:, :half], sin[:, :half]], dim=-1)
    positions = torch.arange(cos.shape[0], device=cos.device)
    return VisionRotary(cos, sin, table, positions)
