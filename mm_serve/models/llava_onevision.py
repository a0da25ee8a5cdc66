"""LLaVA-OneVision: a SigLIP tower over an image's anyres tiles, LLaVA's 2-layer projector,
``image_newline``, and a Qwen2 decoder (our ``LlamaForCausalLM``, q/k/v biases, 1-D RoPE).

An image is ``[num_tiles, 3, tile, tile]`` pixels (``encoders.llava_onevision_processor``): the
base tile, then ``rows x cols`` grid tiles when it is alone in its prompt. ``embed_images``
gives one row per placeholder token: the base tile's features, then the grid's feature map,
unpadded, downsampled past ``anyres_max_N`` tiles, each row followed by ``image_newline``
(``encoders.anyres``, HF's ``pack_image_features``); a lone tile is followed by one newline.

Parameter names: ``vision_tower.vision_model.*``, ``multi_modal_projector.linear_{1,2}.*``,
``image_newline``, ``model.*``, ``lm_head.*``. Accepted: llava-hf's (``language_model.model.*``,
``language_model.lm_head.*``), transformers 5's saved (``vision_tower.*`` without
``vision_model.``) and in-memory names (``model.*`` prefixes)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mm_serve.encoders.anyres import AnyresLayout, anyres_layout, check_pinpoints, max_tiles
from mm_serve.encoders.base import ProcessedImage
from mm_serve.encoders.clip import LlavaMultiModalProjector, tower_weight_name
from mm_serve.encoders.siglip import SiglipFeatureTower
from mm_serve.models.vlm import LLAVA_STYLE_PREFIXES, VisionLanguageModelBase, tiles_on_device


def pack_anyres(
    features: torch.Tensor, layout: AnyresLayout, newline: torch.Tensor
) -> torch.Tensor:
    """``[1 + rows * cols, side**2, hidden]`` tile features -> ``[num_tokens, hidden]``: the
    base tile's, then the grid's map (tile ``(r, c)`` at rows ``r * side...``, columns
    ``c * side...``) cropped by ``layout.crop``, bilinearly resized to ``layout.final`` when
    that differs (``F.interpolate``, as HF), each row followed by ``newline [hidden]``."""
    (rows, cols), side, hidden = layout.grid, layout.side, features.shape[-1]
    grid = features[1:].view(rows, cols, side, side, hidden).permute(4, 0, 2, 1, 3)
    grid = grid.reshape(hidden, rows * side, cols * side)  # [hidden, H, W], as HF lays it out
    (top, left), (height, width) = layout.crop, layout.unpadded
    grid = grid[:, top : top + height, left : left + width]
    if layout.final != layout.unpadded:
        grid = F.interpolate(grid[None], list(layout.final), mode="bilinear")[0]
    final_rows = layout.final[0]
    newlines = newline.to(grid.dtype)[:, None, None].expand(hidden, final_rows, 1)
    grid = torch.cat([grid, newlines], dim=-1).flatten(1, 2).transpose(0, 1)
    return torch.cat([features[0], grid])


class LlavaOnevisionForConditionalGeneration(VisionLanguageModelBase):
    """LLaVA-OneVision: ``vision_tower`` + ``multi_modal_projector`` + ``image_newline`` + the
    Qwen2 LM (1-D RoPE); ``config`` is the HF ``LlavaOnevisionConfig``.

    Raises (at construction):
        ValueError: a select strategy other than "full" (HF's own anyres packing fails with
            "default" on SigLIP, which has no class token), a ``vision_aspect_ratio`` other
            than "anyres_max_N", or grid pinpoints that are not whole tiles.
    """

    PREFIXES = (("model.image_newline", "image_newline"), *LLAVA_STYLE_PREFIXES)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        if config.vision_feature_select_strategy != "full":
            raise ValueError(
                "LLaVA-OneVision supports vision_feature_select_strategy 'full' only, got "
                f"{config.vision_feature_select_strategy!r}."
            )
        vision = config.vision_config
        self.tile, self.side = vision.image_size, vision.image_size // vision.patch_size
        self.max_tiles = max_tiles(config.vision_aspect_ratio)
        self.pinpoints = [tuple(p) for p in config.image_grid_pinpoints]
        check_pinpoints(self.pinpoints, self.tile)
        self.vision_tower = SiglipFeatureTower(vision, config.vision_feature_layer)
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        self.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size))

    def embed_images(self, images: list[ProcessedImage]) -> list[torch.Tensor]:
        """One ``[num_tokens, hidden]`` tensor per image, in order; the tiles of all images go
        through the tower as one batch.

        Raises:
            ValueError: an image whose tiles or token count disagree with its ``image_size``.
        """
        if not images:
            return []
        weight = self.multi_modal_projector.linear_1.weight
        pixel_values = tiles_on_device(images, weight.device).to(weight.dtype)
        features = self.multi_modal_projector(self.vision_tower(pixel_values))
        per_image = features.split([image.pixel_values.shape[0] for image in images])
        return [self._pack(f, image) for f, image in zip(per_image, images, strict=True)]

    def _pack(self, features: torch.Tensor, image: ProcessedImage) -> torch.Tensor:
        """One image's ``[num_tiles, side**2, hidden]`` features -> its placeholder's rows."""
        if features.shape[0] == 1:  # one of several images of a prompt: no anyres grid
            embeddings = torch.cat([features[0], self.image_newline[None].to(features.dtype)])
        else:
            if image.image_size is None:
                raise ValueError("A LLaVA-OneVision anyres image needs its image_size.")
            layout = anyres_layout(
                *image.image_size, self.pinpoints, self.tile, self.side, self.max_tiles
            )
            rows, cols = layout.grid
            if features.shape[0] != 1 + rows * cols:
                raise ValueError(
                    f"{features.shape[0]} tiles for an image of {image.image_size} pixels "
                    f"({rows} x {cols} tiles and the base tile expected)."
                )
            embeddings = pack_anyres(features, layout, self.image_newline)
        if embeddings.shape[0] != image.num_tokens:
            raise ValueError(f"{embeddings.shape[0]} embeddings for {image.num_tokens} tokens.")
        return embeddings

    def rename(self, ckpt_name: str) -> str:
        name = super().rename(ckpt_name)
        if name.startswith("vision_tower."):  # with or without the vision_model level
            return "vision_tower." + tower_weight_name(name.removeprefix("vision_tower."))
        return name
