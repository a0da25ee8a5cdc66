"""The InternViT vision tower of InternVL3 and its pixel-shuffle projector.

InternViT (HF ``InternVLVisionModel``): a ViT with a class token, learned absolute position
embeddings, layer scale, LayerNorm or RMSNorm (``norm_type``) and optional q/k RMSNorm
(``use_qk_norm``):

    x = x + lambda_1 * attention(layernorm_before(x))
    x = x + lambda_2 * mlp(layernorm_after(x))

Its output is the last block's (through ``layernorm`` unless ``use_mean_pooling``) or the
``vision_feature_layer`` hidden state. The projector drops the class token, pixel-shuffles each
tile's ``n x n`` grid by ``1 / downsample_ratio`` (as Idefics3) and applies LayerNorm, linear,
activation, linear. Parameter names are what transformers saves, under ``vision_tower.`` and
``multi_modal_projector.``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mm_serve.encoders.siglip import pixel_shuffle
from mm_serve.kernels.dispatch import get_activation
from mm_serve.models.layers.layernorm import RMSNorm


def _pair(value: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def _norm(config) -> nn.Module:
    """The block norm of ``norm_type``: ``"layer_norm"`` or ``"rms_norm"``."""
    if config.norm_type == "layer_norm":
        return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
    if config.norm_type == "rms_norm":
        return RMSNorm(config.hidden_size, eps=config.layer_norm_eps)
    raise ValueError(f"Unknown norm_type {config.norm_type!r}; expected layer_norm or rms_norm.")


class InternVisionEmbeddings(nn.Module):
    """``[N, 3, H, W] -> [N, 1 + (H / patch) * (W / patch), hidden]``: the class token, then
    the patches in raster order, plus the position embeddings. ``H x W`` must be the
    ``image_size`` they were learned for (InternVL's processor makes every tile that size)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.image_size, patch = _pair(config.image_size), _pair(config.patch_size)
        dim = config.hidden_size
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.patch_embeddings = nn.Module()
        self.patch_embeddings.projection = nn.Conv2d(
            config.num_channels, dim, kernel_size=patch, stride=patch
        )
        num_patches = (self.image_size[0] // patch[0]) * (self.image_size[1] // patch[1])
        self.position_embeddings = (
            nn.Parameter(torch.zeros(1, num_patches + 1, dim))
            if config.use_absolute_position_embeddings
            else None
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        n, _, height, width = pixel_values.shape
        if (height, width) != self.image_size:
            raise ValueError(
                f"InternViT expects {self.image_size[0]}x{self.image_size[1]} tiles, got "
                f"{height}x{width}."
            )
        projection = self.patch_embeddings.projection
        patches = projection(pixel_values.to(projection.weight.dtype)).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(n, -1, -1), patches], dim=1)
        return x if self.position_embeddings is None else x + self.position_embeddings


class InternVisionAttention(nn.Module):
    """Bidirectional multi-head attention over each tile's tokens, ``[N, L, hidden]``; q and k
    RMS-normalised over all heads together (eps 1e-6, as HF) with ``use_qk_norm``."""

    def __init__(self, config) -> None:
        super().__init__()
        dim, bias = config.hidden_size, config.attention_bias
        self.num_heads = config.num_attention_heads
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(dim, dim, bias=bias)
        self.v_proj = nn.Linear(dim, dim, bias=bias)
        self.projection_layer = nn.Linear(dim, dim)
        self.q_norm = RMSNorm(dim) if config.use_qk_norm else None
        self.k_norm = RMSNorm(dim) if config.use_qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(n, length, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)  # scale head_dim ** -0.5, as HF
        return self.projection_layer(out.transpose(1, 2).reshape(n, length, -1))


class InternVisionLayer(nn.Module):
    """One block with layer scale (``lambda_1``, ``lambda_2``); ``[N, L, hidden]``."""

    def __init__(self, config) -> None:
        super().__init__()
        dim = config.hidden_size
        self.attention = InternVisionAttention(config)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(dim, config.intermediate_size)
        self.mlp.fc2 = nn.Linear(config.intermediate_size, dim)
        self.act = get_activation(config.hidden_act)
        self.layernorm_before = _norm(config)
        self.layernorm_after = _norm(config)
        self.lambda_1 = nn.Parameter(torch.ones(dim))
        self.lambda_2 = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        mlp = self.mlp.fc2(self.act(self.mlp.fc1(self.layernorm_after(x))))
        return x + self.lambda_2 * mlp


class InternVisionModel(nn.Module):
    """``forward(pixel_values [N, 3, H, W]) -> [N, 1 + num_patches, hidden]``: HF's
    ``hidden_states[feature_layer]`` (0: the embeddings, ``i``: block ``i``'s output,
    negative from the end), except that ``-1`` is ``last_hidden_state`` (after ``layernorm``
    unless ``use_mean_pooling``). Only the blocks up to that state run.

    Raises ``ValueError`` for a ``feature_layer`` out of range (``__init__``).
    """

    def __init__(self, config, feature_layer: int = -1) -> None:
        super().__init__()
        num_states = config.num_hidden_layers + 1
        if not -num_states <= feature_layer < num_states:
            raise ValueError(
                f"vision_feature_layer {feature_layer} is out of range for an InternViT with "
                f"{config.num_hidden_layers} layers."
            )
        self.last = feature_layer == -1
        self.num_layers_to_run = feature_layer % num_states
        self.embeddings = InternVisionEmbeddings(config)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(
            [InternVisionLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.layernorm = (
            None
            if config.use_mean_pooling
            else nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layer[: self.num_layers_to_run]:
            x = layer(x)
        return self.layernorm(x) if self.last and self.layernorm is not None else x


class InternVLMultiModalProjector(nn.Module):
    """``[N, 1 + n*n, vision_hidden] -> [N, n*n * ratio**2, text_hidden]``: drop the class
    token, ``pixel_shuffle`` by ``1 / downsample_ratio``, then ``linear_2(act(linear_1(
    layer_norm(x))))``, from an ``InternVLConfig``.

    Raises ``ValueError`` (``__init__``) for a ``downsample_ratio`` whose inverse is no
    integer, or a select strategy other than ``"default"`` (HF's only working one).
    """

    def __init__(self, config) -> None:
        super().__init__()
        scale = 1 / config.downsample_ratio
        if scale != int(scale):
            raise ValueError(f"downsample_ratio {config.downsample_ratio} is not 1 / integer.")
        if config.vision_feature_select_strategy != "default":
            raise ValueError(
                f"vision_feature_select_strategy {config.vision_feature_select_strategy!r} "
                "is not supported for InternVL (only 'default': the class token dropped)."
            )
        self.scale = int(scale)
        in_dim = config.vision_config.hidden_size * self.scale**2
        out_dim = config.text_config.hidden_size
        self.layer_norm = nn.LayerNorm(in_dim)
        self.linear_1 = nn.Linear(in_dim, out_dim)
        self.act = get_activation(config.projector_hidden_act)
        self.linear_2 = nn.Linear(out_dim, out_dim)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = pixel_shuffle(features[:, 1:], self.scale)
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))
