"""The SigLIP vision tower of Idefics3 / SmolVLM and LLaVA-OneVision, and Idefics3's
pixel-shuffle connector.

The layers are ``clip.CLIPEncoderLayer`` (same parameter names) with the config's
``hidden_act``. Unlike CLIP: no class token, no pre-LayerNorm, a biased patch convolution, a
``post_layernorm`` that runs, and Idefics3's bucketed position ids (a tile of ``n x n`` patches,
any ``n``, uses the learned ``image_size / patch`` grid). Parameter names equal HF
``Idefics3VisionTransformer``'s; the connector's is ``modality_projection.proj.weight``."""

from __future__ import annotations

import torch
from torch import nn

from mm_serve.encoders.clip import CLIPEncoder, feature_state_indices


def bucketed_position_ids(num_patches: int, num_patches_per_side: int) -> torch.Tensor:
    """``[num_patches**2]`` position ids of a full tile of ``num_patches`` per side, computed
    as HF's ``Idefics3VisionEmbeddings`` does (float32 fractional coordinates bucketed into the
    learned grid of ``num_patches_per_side`` per side): ``arange`` when the two are equal."""
    side = num_patches_per_side
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    step = 1.0 / torch.tensor([num_patches])  # float32, as HF's 1.0 / patch counts
    coords = torch.arange(num_patches, dtype=torch.float32)[None, :] * step[:, None]
    buckets = torch.bucketize(torch.clamp(coords, max=1.0 - 1e-6), boundaries, right=True)[0]
    return (buckets[:, None] * side + buckets[None, :]).reshape(-1)


class SiglipVisionEmbeddings(nn.Module):
    """``[N, 3, S, S] -> [N, (S // patch)**2, hidden]``: patch convolution plus the bucketed
    position embeddings (square tiles, no padding). As HF's convolution, a side that is not a
    whole number of patches drops its last pixels (SigLIP-so400m: 384 / 14 -> 27 patches)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.num_patches_per_side = config.image_size // config.patch_size
        dim = config.hidden_size
        self.patch_embedding = nn.Conv2d(
            config.num_channels, dim, config.patch_size, stride=config.patch_size
        )
        self.position_embedding = nn.Embedding(self.num_patches_per_side**2, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        _, _, height, width = pixel_values.shape
        if height != width:
            raise ValueError(f"Expected square tiles, got {height}x{width}.")
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        ids = bucketed_position_ids(height // self.patch_size, self.num_patches_per_side)
        return patches + self.position_embedding(ids.to(weight.device))


class SiglipVisionTransformer(nn.Module):
    """``forward(pixel_values [N, 3, S, S]) -> [N, (S / patch)**2, hidden]``: every layer,
    then ``post_layernorm`` (Idefics3 takes the last hidden state)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = CLIPEncoder(config)  # SigLIP's layers are CLIP's
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class SiglipFeatureTower(nn.Module):
    """SigLIP hidden states as LLaVA-OneVision selects them (``vision_feature_layer``).

    ``forward(pixel_values [N, 3, S, S]) -> [N, (S / patch)**2, hidden * len(layers)]``: the
    states of HF's ``hidden_states`` (0: the embeddings, ``i``: layer ``i``'s output, without
    ``post_layernorm``; see ``clip.feature_state_indices``), concatenated along hidden in the
    order given. Runs only the layers it needs; every layer is built so the checkpoint loads.
    Parameter names: ``vision_model.*`` (``SiglipVisionTransformer``'s); a checkpoint's are
    ``X`` (as transformers 5 saves them) or ``vision_model.X``: ``clip.tower_weight_name``.
    """

    def __init__(self, vision_config, feature_layer: int | list[int]) -> None:
        super().__init__()
        self.feature_states = feature_state_indices(feature_layer, vision_config)
        self.vision_model = SiglipVisionTransformer(vision_config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        model = self.vision_model
        x = model.embeddings(pixel_values)  # [N, L, hidden]
        states = {0: x}
        for i in range(max(self.feature_states)):
            x = model.encoder.layers[i](x)
            states[i + 1] = x
        features = [states[i] for i in self.feature_states]
        return features[0] if len(features) == 1 else torch.cat(features, dim=-1)


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """Space-to-depth of a square grid of tokens, as HF's ``Idefics3Connector.pixel_shuffle``:
    ``[N, L, D] -> [N, L / scale**2, D * scale**2]`` (each ``scale x scale`` block of the
    ``sqrt(L) x sqrt(L)`` grid becomes one token, blocks in raster order)."""
    n, length, dim = x.shape
    side = int(length**0.5)
    if side * side != length or side % scale:
        raise ValueError(f"Cannot pixel-shuffle {length} tokens by {scale}.")
    x = x.view(n, side, side // scale, dim * scale)  # merge `scale` columns
    x = x.permute(0, 2, 1, 3).reshape(n, side // scale, side // scale, dim * scale * scale)
    return x.permute(0, 2, 1, 3).reshape(n, length // scale**2, dim * scale**2)


class Idefics3Connector(nn.Module):
    """``[N, L, vision_hidden] -> [N, L / scale**2, text_hidden]``: ``pixel_shuffle`` then one
    linear map without bias (``modality_projection.proj``), from an ``Idefics3Config``."""

    def __init__(self, config) -> None:
        super().__init__()
        self.scale_factor = int(config.scale_factor)
        in_dim = config.vision_config.hidden_size * self.scale_factor**2
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(
            in_dim, config.text_config.hidden_size, bias=False
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffle(features, self.scale_factor))
