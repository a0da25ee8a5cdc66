"""LLaVA (1.5): CLIP vision tower + 2-layer MLP projector in front of a Llama decoder (our
``LlamaForCausalLM``, 1-D RoPE).

An image becomes ``(image_size / patch)**2`` tokens (class token dropped, ``"default"`` select
strategy), which replace its ``<image>`` placeholder tokens.

Parameter names: ``vision_tower.vision_model.*``, ``multi_modal_projector.linear_{1,2}.*``,
``model.*``, ``lm_head.*``. Accepted: llava-hf's (``language_model.model.*``,
``language_model.lm_head.*``), transformers 5's saved (``vision_tower.*`` without
``vision_model.``) and in-memory names (``model.*`` prefixes)."""

from __future__ import annotations

from typing import Any

import torch

from mm_serve.encoders.base import ProcessedImage
from mm_serve.encoders.clip import CLIPVisionTower, LlavaMultiModalProjector, tower_weight_name
from mm_serve.models.vlm import LLAVA_STYLE_PREFIXES, VisionLanguageModelBase


class LlavaForConditionalGeneration(VisionLanguageModelBase):
    """LLaVA: ``vision_tower`` + ``multi_modal_projector`` + the Llama LM (1-D RoPE); ``config``
    is the HF ``LlavaConfig``."""

    PREFIXES = LLAVA_STYLE_PREFIXES

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.vision_tower = CLIPVisionTower(
            config.vision_config,
            config.vision_feature_layer,
            config.vision_feature_select_strategy,
        )
        self.multi_modal_projector = LlavaMultiModalProjector(config)

    def embed_images(self, images: list[ProcessedImage]) -> list[torch.Tensor]:
        """One ``[num_tokens, hidden]`` tensor per image (projected CLIP features), in order.

        Each image's ``pixel_values`` is ``[3, H, W]``, all of the same size (the processor
        crops to the tower's ``image_size``); they go through the tower as one batch.
        """
        if not images:
            return []
        weight = self.multi_modal_projector.linear_1.weight
        pixel_values = torch.stack([image.pixel_values for image in images])
        pixel_values = pixel_values.to(device=weight.device, dtype=weight.dtype)
        features = self.vision_tower(pixel_values)  # [N, num_tokens, vision_hidden]
        return list(self.multi_modal_projector(features).unbind(0))

    def rename(self, ckpt_name: str) -> str:
        name = super().rename(ckpt_name)
        if name.startswith("vision_tower."):  # with or without the vision_model level
            return "vision_tower." + tower_weight_name(name.removeprefix("vision_tower."))
        return name
