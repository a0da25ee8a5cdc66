"""Qwen3-VL vision tower: the Qwen2-VL ViT (``encoders/qwen2_vl.py``: input and patch order;
16-pixel patches, 2 frames) with a learned, interpolated position embedding and DeepStack
mergers.

- the patch embedding ``Conv3d`` has a bias;
- a learned ``[side * side, dim]`` table (``pos_embed``) is resampled bilinearly with aligned
  corners to each image's ``h x w`` grid (HF ``get_vision_interpolation_indices_and_weights``)
  and added to the patch embeddings;
- the MLP is ``linear_fc1``/``linear_fc2`` with the config's ``hidden_act``;
- DeepStack (arXiv:2406.04334): the hidden states after each block in
  ``deepstack_visual_indexes`` go through their own merger (``deepstack_merger_list``, LayerNorm
  over the concatenated ``merge**2`` patches); the LM adds them after its first layers.

Output: ``[num_patches / merge**2, (1 + num_deepstack) * out]``, the merged tokens then their
DeepStack features side by side, so an image's rows travel as one (encoder cache, chunk slices).
Parameter names equal HF ``Qwen3VLVisionModel`` (checkpoint ``model.visual.*``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from mm_serve.encoders.qwen2_vl import (
    PatchEmbed,
    TowerPlan,
    VisionBlock,
    check_grid,
    frame_bounds,
    rope_theta,
    rotary_cos_sin,
)
from mm_serve.kernels.dispatch import get_activation, varlen_segments
from mm_serve.kernels.rotary import vision_rotary
from mm_serve.utils.transfer import host_to_device


def _axis_taps(size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps along one axis, corners aligned: ``(indices [size, 2] long, weights
    [size, 2] float32)`` into a table of ``side`` entries for ``size`` output positions.

    Output position ``i`` samples the table at ``s = i * (side - 1) / (size - 1)`` (0 for
    ``size == 1``): entries ``floor(s)`` and ``floor(s) + 1`` (clamped to the table) with
    weights ``1 - |s - floor(s) - k|`` for ``k = 0, 1``, in float32 as HF computes them.
    """
    index = torch.arange(size, dtype=torch.float32)
    src = index * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_taps(
    grids: list[list[int]], side: int, merge: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The four bilinear taps of every patch into the ``side x side`` position table:
    ``(indices [num_patches, 4] long, weights [num_patches, 4] float32)``, rows in the tower's
    order (image by image, frame by frame, merge windows row-major; frames repeat the table).
    Taps are ``(y0, x0), (y0, x1), (y1, x0), (y1, x1)``; weights the products of the axes'."""

    def tower_order(grid: torch.Tensor, t: int) -> torch.Tensor:
        """``[h, w, 4]`` -> ``[t * h * w, 4]``: merge windows row-major, repeated per frame."""
        h, w = grid.shape[:2]
        blocks = grid.view(h // merge, merge, w // merge, merge, 4).transpose(1, 2)
        return blocks.reshape(-1, 4).repeat(t, 1)

    indices, weights = [], []
    for t, h, w in grids:
        (ty, wy), (tx, wx) = _axis_taps(h, side), _axis_taps(w, side)
        index = ty[:, None, :, None] * side + tx[None, :, None, :]  # [h, w, 2, 2]
        indices.append(tower_order(index.reshape(h, w, 4), t))
        weight = wy[:, None, :, None] * wx[None, :, None, :]
        weights.append(tower_order(weight.reshape(h, w, 4), t))
    return torch.cat(indices), torch.cat(weights)


@dataclass(frozen=True)
class Qwen3TowerPlan(TowerPlan):
    """A ``TowerPlan`` plus the position table's taps of every patch (``position_taps``, on
    the device)."""

    pos_indices: torch.Tensor | None = None  # [N, 4] long
    pos_weights: torch.Tensor | None = None  # [N, 4] float32


class Qwen3VisionMLP(nn.Module):
    """``linear_fc2(act(linear_fc1(x)))``, ``[N, dim]``; ``act`` is ``hidden_act``."""

    def __init__(self, dim: int, hidden_dim: int, hidden_act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden_dim)
        self.act = get_activation(hidden_act)
        self.linear_fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3PatchMerger(nn.Module):
    """``[N, dim] -> [N / merge**2, out_dim]``: LayerNorm (eps 1e-6), every ``merge**2``
    consecutive rows concatenated, then Linear-GELU-Linear. The main merger norms each patch
    (``[dim]``); a DeepStack merger (``postshuffle_norm``) the concatenated rows
    (``[dim * merge**2]``), as HF ``Qwen3VLVisionPatchMerger``."""

    def __init__(self, dim: int, out_dim: int, merge: int, postshuffle_norm: bool) -> None:
        super().__init__()
        self.hidden_size = dim * merge**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.hidden_size if postshuffle_norm else dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden_size, self.hidden_size)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.hidden_size, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.view(-1, self.hidden_size))
        else:
            x = self.norm(x).view(-1, self.hidden_size)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionTransformer(nn.Module):
    """The Qwen3-VL vision tower, from ``vision_config`` (``Qwen3VLVisionConfig``).

    ``forward(pixel_values [num_patches, C*T*P*P], grid_thw [num_images, 3] long)
    -> [num_patches // merge**2, (1 + num_deepstack) * out_hidden_size]``: per merged token,
    the merger's output then each DeepStack merger's (in block order), images concatenated in
    input order. Raises ``ValueError`` if ``grid_thw`` does not fit.

    ``plan(grids, device)`` and ``run(pixel_values, plan)`` split the forward into its
    host-side part and its device work, as the Qwen2-VL towers do (``worker.tower_graphs``).
    """

    def __init__(self, vision_config) -> None:
        super().__init__()
        cfg = vision_config
        dim, out = cfg.hidden_size, cfg.out_hidden_size
        self.spatial_merge_size = merge = cfg.spatial_merge_size
        self.head_dim = dim // cfg.num_heads
        self.rope_theta = rope_theta(cfg)
        self.num_grid_per_side = math.isqrt(cfg.num_position_embeddings)
        if self.num_grid_per_side**2 != cfg.num_position_embeddings:
            raise ValueError(
                f"num_position_embeddings={cfg.num_position_embeddings} is not a square grid."
            )
        self.patch_embed = PatchEmbed(
            cfg.patch_size, cfg.temporal_patch_size, cfg.in_channels, dim, bias=True
        )
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, dim)
        mlp = cfg.intermediate_size, cfg.hidden_act
        self.blocks = nn.ModuleList(
            VisionBlock(dim, cfg.num_heads, Qwen3VisionMLP(dim, *mlp)) for _ in range(cfg.depth)
        )
        self.merger = Qwen3PatchMerger(dim, out, merge, postshuffle_norm=False)
        self.deepstack_visual_indexes = [int(i) for i in cfg.deepstack_visual_indexes]
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(dim, out, merge, postshuffle_norm=True)
            for _ in self.deepstack_visual_indexes
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = check_grid(pixel_values, grid_thw, self.spatial_merge_size)
        return self.run(pixel_values, self.plan(grids, pixel_values.device))

    def plan(
        self, grids: list[list[int]], device: torch.device, dense: bool = True
    ) -> Qwen3TowerPlan:
        """The host-side part of a forward over images of ``grids`` (``[t, h, w]`` each): the
        rotary tables, the per-frame attention segments and the position taps, on ``device``.
        """
        merge, dtype = self.spatial_merge_size, self.patch_embed.proj.weight.dtype
        cos, sin = rotary_cos_sin(grids, merge, self.head_dim, self.rope_theta, device)
        segments = varlen_segments(frame_bounds(grids), device, dtype, dense)
        indices, weights = position_taps(grids, self.num_grid_per_side, merge)
        return Qwen3TowerPlan(
            vision_rotary(cos, sin),
            segments,
            segments,
            pos_indices=host_to_device(indices, device),
            pos_weights=host_to_device(weights, device),
        )

    def run(self, pixel_values: torch.Tensor, plan: Qwen3TowerPlan) -> torch.Tensor:
        """``forward`` with the plan made: device work only, no host synchronisation."""
        x = self.patch_embed(pixel_values)  # [N, dim]
        taps = self.pos_embed(plan.pos_indices) * plan.pos_weights[:, :, None]  # [N, 4, dim]
        x = x + taps.sum(1).to(x.dtype)
        features, residual = [], None  # DeepStack's, in block order (as HF's list)
        for i, block in enumerate(self.blocks):
            x, residual = block(x, residual, plan.full, plan.rotary)
            if i in self.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)]
                features.append(merger(x + residual))
        return torch.cat([self.merger(x + residual), *features], dim=-1)
