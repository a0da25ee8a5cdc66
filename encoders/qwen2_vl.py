"""Qwen2-VL vision tower: a ViT over flattened patches with 2-D rotary and a 2x2 patch merger.

Input is the Qwen2-VL image processor's (``encoders/base.py``): every image's patches flattened
to ``C * temporal_patch * patch * patch`` values, each ``merge x merge`` block contiguous
(merge-window order), kept throughout so the merger concatenates ``merge**2`` consecutive rows.
Parameter names equal HF ``Qwen2VisionTransformerPretrainedModel``'s (checkpoint ``visual.*``);
no buffers (rotary frequencies recomputed each forward), so a ``meta`` build needs no rebuild.
The pieces shared with Qwen2.5-VL (patch embedding, rotary, varlen attention, merger) live here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mm_serve.kernels.dispatch import (
    apply_vision_rotary,
    get_activation,
    varlen_attention,
    varlen_segments,
)
from mm_serve.kernels.dispatch_linear import linear_quick_gelu
from mm_serve.kernels.rotary import VisionRotary, vision_rotary
from mm_serve.kernels.varlen_attention import Segments
from mm_serve.models.layers.layernorm import LayerNorm, RMSNorm
from mm_serve.utils.transfer import host_to_device


def rope_theta(vision_config) -> float:
    """The vision rotary base: ``rope_parameters["rope_theta"]`` (transformers 5), else 10000."""
    params = getattr(vision_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", 10000.0))


def check_grid(pixel_values: torch.Tensor, grid_thw: torch.Tensor, merge: int) -> list[list[int]]:
    """``grid_thw`` as a list of ``[t, h, w]``; raises ``ValueError`` if it does not describe
    ``pixel_values`` (row count) or a side is not a multiple of the merge size."""
    grids = grid_thw.tolist()
    if any(h % merge or w % merge for _, h, w in grids):
        raise ValueError(f"grid_thw {grids}: h and w must be multiples of {merge}.")
    num_patches = sum(t * h * w for t, h, w in grids)
    if num_patches != pixel_values.shape[0]:
        raise ValueError(
            f"grid_thw {grids} describes {num_patches} patches, pixel_values has "
            f"{pixel_values.shape[0]} rows."
        )
    return grids


def frame_bounds(grids: list[list[int]]) -> list[int]:
    """``num_frames + 1`` row boundaries: every frame of every image attends only to itself
    (HF's convention: ``t`` segments of ``h * w`` patches per image)."""
    bounds = [0]
    for t, h, w in grids:
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


def rotary_cos_sin(
    grids: list[list[int]], merge: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D rotary tables ``(cos, sin)``, each ``[num_patches, head_dim]`` float32.

    A patch at row ``y``, column ``x`` of its image gets angles ``y * inv_freq`` on the first
    quarter of the head dim and ``x * inv_freq`` on the second (``head_dim // 4`` frequencies
    each), the half repeated over both halves (``rotate_half`` convention). Rows are listed in
    merge-window order and repeated for every frame, as HF ``get_vision_position_ids`` does.
    """
    positions = []
    for t, h, w in grids:
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        # [h, w] -> [h/m, m, w/m, m] -> [h/m, w/m, m, m]: each merge window contiguous.
        ys, xs = (p.reshape(h // merge, merge, w // merge, merge).transpose(1, 2) for p in (ys, xs))
        positions.append(torch.stack([ys.flatten(), xs.flatten()], dim=-1).repeat(t, 1))
    pos = host_to_device(torch.cat(positions).float(), device)  # [N, 2]
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, device=device, dtype=torch.float32) / half)
    freqs = (pos[:, :, None] * inv_freq).flatten(1)  # [N, 2 * head_dim // 4]: y | x
    emb = torch.cat([freqs, freqs], dim=-1)  # [N, head_dim]
    return emb.cos(), emb.sin()


@dataclass(frozen=True)
class TowerPlan:
    """What a tower forward needs besides the pixels, made on the host from the grids alone
    (``plan``): the rotary tables, the per-frame attention segments (``full``) and, for
    Qwen2.5-VL, the window segments and the window order of the merged tokens (``index``:
    ``[num_tokens]`` long, position ``j`` of the window order holds input token ``index[j]``;
    ``inverse`` undoes it)."""

    rotary: VisionRotary
    full: Segments
    windows: Segments
    index: torch.Tensor | None = None
    inverse: torch.Tensor | None = None


class PatchEmbed(nn.Module):
    """``[N, C * T * P * P] -> [N, embed_dim]``: HF's ``Conv3d`` with kernel = stride = (T, P, P)
    (with a bias for Qwen3-VL).

    The weight keeps the ``Conv3d`` shape ``[embed_dim, C, T, P, P]`` for loading, but the
    forward is the equivalent matmul over the flattened patch (one kernel window per row), which
    is much faster than a ``Conv3d`` call on such inputs.
    """

    def __init__(
        self, patch_size: int, temporal_patch_size: int, in_channels: int, dim: int, bias=False
    ):
        super().__init__()
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, dim, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.flatten(1), self.proj.bias)


class VisionAttention(nn.Module):
    """Fused-qkv self-attention with 2-D rotary, restricted to ``segments``: ``[N, dim]``."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, segments: Segments, rotary: VisionRotary) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # [N, heads, head_dim]
        q, k = apply_vision_rotary(q, k, rotary)
        return self.proj(varlen_attention(q, k, v, segments).reshape(n, -1))


class PatchMerger(nn.Module):
    """``[N, context_dim] -> [N / merge**2, out_dim]``: norm each patch, concatenate every
    ``merge**2`` consecutive rows (one merge window), then Linear-GELU-Linear.

    The norm is LayerNorm (Qwen2-VL) or RMSNorm (Qwen2.5-VL), eps 1e-6, named ``ln_q``.
    """

    def __init__(self, context_dim: int, out_dim: int, merge: int, rms_norm: bool = False):
        super().__init__()
        self.hidden_size = context_dim * merge**2
        self.ln_q = (RMSNorm if rms_norm else LayerNorm)(context_dim, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.hidden_size, self.hidden_size),
            nn.GELU(),
            nn.Linear(self.hidden_size, out_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden_size))


class VisionMlp(nn.Module):
    """``fc2(act(fc1(x)))``, ``[N, dim]``; ``act`` is the config's ``hidden_act`` (QuickGELU)."""

    def __init__(self, dim: int, hidden_dim: int, hidden_act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.hidden_act = hidden_act
        self.act = get_activation(hidden_act)  # QuickGELU: one Triton pass on CUDA
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One GEMM with the activation for large batches; a LoRA-wrapped fc1 (not an
        # nn.Linear: ``lora.layers.LoRAVisionLinear``) runs as its own module.
        if self.hidden_act == "quick_gelu" and isinstance(self.fc1, nn.Linear):
            return self.fc2(linear_quick_gelu(x, self.fc1.weight, self.fc1.bias))
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm block: ``h + attn(norm1(h))``, then ``h + mlp(norm2(h))``; the norms are
    LayerNorm (Qwen2-VL) or RMSNorm (Qwen2.5-VL, weight only), eps 1e-6.

    The residual stream travels in two parts, ``x + residual`` (vLLM's convention), so that each
    residual add is fused into the norm after it (``kernels.triton_norm``): ``forward(x,
    residual, segments, rotary) -> (x', residual')`` with ``x' + residual'`` the block's output
    for the input ``x + residual`` (``residual`` None: ``x`` alone), all ``[N, dim]``.
    """

    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, rms_norm: bool = False) -> None:
        super().__init__()
        norm = RMSNorm if rms_norm else LayerNorm
        self.norm1, self.norm2 = norm(dim, eps=1e-6), norm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        segments: Segments,
        rotary: VisionRotary,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = (self.norm1(x), x) if residual is None else self.norm1(x, residual)
        normed, residual = self.norm2(self.attn(normed, segments, rotary), residual)
        return self.mlp(normed), residual


class Qwen2VisionTransformer(nn.Module):
    """The Qwen2-VL vision tower, from the checkpoint's ``vision_config`` (``Qwen2VLVisionConfig``).

    ``forward(pixel_values [num_patches, C*T*P*P], grid_thw [num_images, 3] long)
    -> [num_patches // spatial_merge_size**2, hidden_size]`` (``hidden_size`` = the LM's width):
    the images' embeddings concatenated in input order, image ``i`` taking
    ``t * h * w // merge**2`` rows. Raises ``ValueError`` if ``grid_thw`` does not fit.
    """

    def __init__(self, vision_config) -> None:
        cfg = vision_config
        dim, hidden = cfg.embed_dim, int(cfg.embed_dim * cfg.mlp_ratio)
        self._build(cfg, dim, cfg.hidden_size, lambda: VisionMlp(dim, hidden, cfg.hidden_act))

    def _build(self, cfg, dim: int, out_dim: int, mlp, rms_norm: bool = False) -> None:
        """The modules of a tower of width ``dim`` and output width ``out_dim``: the patch
        embedding, ``cfg.depth`` blocks of ``mlp()`` and the merger (norms: ``rms_norm``)."""
        super().__init__()
        self.spatial_merge_size = cfg.spatial_merge_size
        self.head_dim = dim // cfg.num_heads
        self.rope_theta = rope_theta(cfg)
        self.fullatt_block_indexes = set(range(cfg.depth))  # blocks over whole frames
        self.patch_embed = PatchEmbed(cfg.patch_size, cfg.temporal_patch_size, cfg.in_channels, dim)
        self.blocks = nn.ModuleList(
            VisionBlock(dim, cfg.num_heads, mlp(), rms_norm) for _ in range(cfg.depth)
        )
        self.merger = PatchMerger(dim, out_dim, cfg.spatial_merge_size, rms_norm)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = check_grid(pixel_values, grid_thw, self.spatial_merge_size)
        return self.run(pixel_values, self.plan(grids, pixel_values.device))

    def plan(self, grids: list[list[int]], device: torch.device, dense: bool = True) -> TowerPlan:
        """The host-side part of a forward over images of ``grids`` (``[t, h, w]`` each): the
        rotary tables and attention segments, on ``device``. It depends on the grids alone,
        so a CUDA graph of ``run`` can keep it (``worker.tower_graphs``). Equal segments go
        to cuDNN unless not ``dense`` (``kernels.varlen_attention.make_segments``)."""
        merge, dtype = self.spatial_merge_size, self.patch_embed.proj.weight.dtype
        cos, sin = rotary_cos_sin(grids, merge, self.head_dim, self.rope_theta, device)
        segments = varlen_segments(frame_bounds(grids), device, dtype, dense)
        return TowerPlan(vision_rotary(cos, sin), segments, segments)

    def run(self, pixel_values: torch.Tensor, plan: TowerPlan) -> torch.Tensor:
        """``forward`` with the plan made: device work only, no host synchronisation."""
        x = self.patch_embed(pixel_values)  # [N, dim]
        if plan.index is not None:  # Qwen2.5-VL: the patches in window order
            x = to_window_order(x, plan.index, self.spatial_merge_size)
        residual = None
        for i, block in enumerate(self.blocks):
            full = i in self.fullatt_block_indexes
            x, residual = block(x, residual, plan.full if full else plan.windows, plan.rotary)
        x = self.merger(x + residual)
        return x if plan.inverse is None else x[plan.inverse]


def to_window_order(t: torch.Tensor, index: torch.Tensor, merge: int) -> torch.Tensor:
    """Rows ``[N, d]`` permuted window by window (whole merge windows move together)."""
    return t.view(-1, merge * merge, t.shape[-1])[index].flatten(0, 1)
