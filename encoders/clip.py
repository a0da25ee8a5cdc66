"""CLIP vision tower as LLaVA uses it, and LLaVA's multimodal projector.

``CLIPVisionTower`` returns the hidden state of one encoder layer (or several, concatenated
along hidden), optionally without the class token, and runs only the layers it needs (every
layer is still built, so the checkpoint loads completely).

Parameter names: the classic CLIP checkpoints', under ``vision_model.`` (``embeddings.*``,
``pre_layrnorm`` (sic), ``encoder.layers.{i}.*``, ``post_layernorm``). ``tower_weight_name``
maps the other forms to ours: ``openai/clip-vit-*`` (text tower tensors skipped), llava-hf's
``vision_tower.vision_model.*`` and ``multi_modal_projector.linear_{1,2}.*``, and transformers
5's ``vision_tower.embeddings.*`` (no ``vision_model`` level)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mm_serve.kernels.dispatch import get_activation

SELECT_STRATEGIES = ("default", "full")


def tower_weight_name(name: str) -> str:
    """A checkpoint tensor name relative to the tower (``vision_model.X`` or, as transformers 5
    saves it, ``X``) -> our parameter name ``vision_model.X``."""
    return name if name.startswith("vision_model.") else "vision_model." + name


def feature_state_indices(feature_layer: int | list[int], vision_config) -> list[int]:
    """``vision_feature_layer`` (an index or a list of them into HF's ``hidden_states``: 0 the
    embeddings, ``i`` layer ``i``'s output, negative from the end) as non-negative indices, in
    order. Raises ``ValueError`` for an empty list or an index out of range of the tower's
    ``num_hidden_layers + 1`` states."""
    num_states = vision_config.num_hidden_layers + 1
    layers = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
    if not layers or any(not -num_states <= i < num_states for i in layers):
        raise ValueError(
            f"vision_feature_layer {feature_layer!r} is out of range for a vision tower with "
            f"{vision_config.num_hidden_layers} layers."
        )
    return [i % num_states for i in layers]


class CLIPVisionEmbeddings(nn.Module):
    """``[N, 3, H, W] -> [N, 1 + (H / patch)**2, hidden]``: class token, then the patches in
    raster order, plus learned position embeddings. ``H = W = image_size`` (no interpolation)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.image_size = config.image_size
        dim = config.hidden_size
        self.class_embedding = nn.Parameter(torch.empty(dim))
        self.patch_embedding = nn.Conv2d(
            config.num_channels, dim, config.patch_size, stride=config.patch_size, bias=False
        )
        num_positions = (config.image_size // config.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        n, _, height, width = pixel_values.shape
        if height != self.image_size or width != self.image_size:
            raise ValueError(
                f"CLIP expects {self.image_size}x{self.image_size} images, got {height}x{width}."
            )
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(n, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    """Bidirectional multi-head attention over each image's tokens: ``[N, L, hidden]``."""

    def __init__(self, config) -> None:
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, _ = x.shape
        q, k, v = (
            proj(x).view(n, length, self.num_heads, -1).transpose(1, 2)  # [N, heads, L, d]
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v)  # scale head_dim ** -0.5, as HF
        return self.out_proj(out.transpose(1, 2).reshape(n, length, -1))


class CLIPMLP(nn.Module):
    """``fc2(act(fc1(x)))``; ``act`` is the config's ``hidden_act`` (QuickGELU for CLIP)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = get_activation(config.hidden_act)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``; ``[N, L, hidden]``."""

    def __init__(self, config) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.layer_norm_eps
        self.self_attn = CLIPAttention(config)
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.mlp = CLIPMLP(config)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [CLIPEncoderLayer(config) for _ in range(config.num_hidden_layers)]
        )


class CLIPVisionTransformer(nn.Module):
    """The parameters of HF's CLIP vision model; ``CLIPVisionTower`` drives the forward."""

    def __init__(self, config) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = CLIPEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class CLIPVisionTower(nn.Module):
    """CLIP vision features as LLaVA selects them (``vision_feature_layer`` / ``_select_strategy``).

    ``feature_layer`` indexes HF's ``hidden_states`` tuple: 0 is the embeddings after
    ``pre_layrnorm``, ``i`` the output of layer ``i``, negative counts from the end (-1 = last
    layer, -2 = penultimate, LLaVA-1.5's choice); a list concatenates those states along hidden,
    in list order. ``select_strategy``: ``"default"`` drops the class token, ``"full"`` keeps it.

    ``forward(pixel_values [N, 3, H, W]) -> [N, num_tokens, hidden * len(feature_layers)]`` with
    ``num_tokens = (H / patch)**2`` (+1 for ``"full"``). Raises ``ValueError`` for a layer index
    out of range, an unknown strategy, or an image of the wrong size.
    """

    def __init__(self, vision_config, feature_layer: int | list[int], select_strategy: str):
        super().__init__()
        if select_strategy not in SELECT_STRATEGIES:
            raise ValueError(
                f"Unknown vision_feature_select_strategy {select_strategy!r}; "
                f"expected one of {SELECT_STRATEGIES}."
            )
        self.feature_states = feature_state_indices(feature_layer, vision_config)
        self.num_layers_to_run = max(self.feature_states)
        self.select_strategy = select_strategy
        self.vision_model = CLIPVisionTransformer(vision_config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        model = self.vision_model
        x = model.pre_layrnorm(model.embeddings(pixel_values))  # [N, L, hidden]
        states = {0: x}
        for i in range(self.num_layers_to_run):
            x = model.encoder.layers[i](x)
            states[i + 1] = x
        features = [states[i] for i in self.feature_states]
        if self.select_strategy == "default":
            features = [f[:, 1:] for f in features]
        return features[0] if len(features) == 1 else torch.cat(features, dim=-1)


class LlavaMultiModalProjector(nn.Module):
    """``linear_2(act(linear_1(x)))``: ``[..., vision_hidden * num_feature_layers] ->
    [..., text_hidden]``, from a ``LlavaConfig`` (checkpoint ``multi_modal_projector.*``)."""

    def __init__(self, config) -> None:
        super().__init__()
        layers = config.vision_feature_layer
        num_feature_layers = 1 if isinstance(layers, int) else len(layers)
        in_dim = config.vision_config.hidden_size * num_feature_layers
        out_dim = config.text_config.hidden_size
        bias = getattr(config, "multimodal_projector_bias", True)
        self.linear_1 = nn.Linear(in_dim, out_dim, bias=bias)
        self.act = get_activation(config.projector_hidden_act)
        self.linear_2 = nn.Linear(out_dim, out_dim, bias=bias)

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(image_features)))
