"""Gemma 3 (4B and up): a SigLIP tower, Gemma 3's multimodal projector, and the Gemma 3 LM.

An image is ``[3, S, S]`` pixels (``encoders.gemma3_processor``, S the tower's ``image_size``).
The tower's ``(S / patch)**2`` patch features are average-pooled to ``mm_tokens_per_image``,
RMS-normed (``1 + weight``) and projected to the LM's width (HF
``Gemma3MultiModalProjector``). The placeholder is ``<start_of_image>``, ``mm_tokens_per_image``
x ``<image_soft_token>``, ``<end_of_image>``; ``embed_images`` returns a row per token (the
tags' scaled embeddings, the features at the soft tokens).

In prefill an image's soft tokens attend to each other (HF's token-type mask,
``bidirectional_images``): the scheduler never cuts an image between chunks, and each gets the
image's end as key limit.

Parameter names: ``vision_tower.*``, ``multi_modal_projector.{mm_input_projection_weight,
mm_soft_emb_norm.weight}``, ``model.*``, ``lm_head.*``. Accepted: transformers 5's
(``model.vision_tower.vision_model.*``, ``model.multi_modal_projector.*``,
``model.language_model.*``) and the hub's (``vision_tower.vision_model.*``,
``multi_modal_projector.*``, ``language_model.model.*``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mm_serve.encoders.base import ProcessedImage
from mm_serve.encoders.siglip import SiglipVisionTransformer
from mm_serve.models.gemma3_text import Gemma3ForCausalLM, GemmaRMSNorm
from mm_serve.models.vlm import VisionLanguageModelBase


class Gemma3MultiModalProjector(nn.Module):
    """``[N, (S / patch)**2, vision_hidden] -> [N, mm_tokens_per_image, text_hidden]``: average
    pooling of the patch grid to ``sqrt(mm_tokens_per_image)`` per side, Gemma RMSNorm, then
    ``@ mm_input_projection_weight`` (``[vision_hidden, text_hidden]``), as HF's."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision, text = config.vision_config, config.text_config
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision.hidden_size, text.hidden_size), requires_grad=False
        )
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = int(config.mm_tokens_per_image**0.5)
        if (
            tokens_per_side**2 != config.mm_tokens_per_image
            or self.patches_per_side % tokens_per_side
        ):
            raise ValueError(
                f"mm_tokens_per_image={config.mm_tokens_per_image} is not a square grid that "
                f"pools {self.patches_per_side} patches per side evenly."
            )
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        n, _, dim = features.shape
        side = self.patches_per_side
        grid = features.transpose(1, 2).reshape(n, dim, side, side)
        pooled = nn.functional.avg_pool2d(grid, self.kernel, self.kernel).flatten(2)
        normed = self.mm_soft_emb_norm(pooled.transpose(1, 2))
        return (normed @ self.mm_input_projection_weight).to(features.dtype)


class Gemma3ForConditionalGeneration(VisionLanguageModelBase, Gemma3ForCausalLM):
    """Gemma 3: ``vision_tower`` + ``multi_modal_projector`` + the Gemma 3 LM; ``config`` is the
    HF ``Gemma3Config``. ``image_token_id`` is the soft token (``<image_soft_token>``); the
    prompt's placeholder is ``<start_of_image>`` (``ModelFamily.placeholder_token``)."""

    bidirectional_images = True
    PREFIXES = (
        ("model.vision_tower.vision_model.", "vision_tower."),
        ("vision_tower.vision_model.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    )

    def __init__(self, config: Any) -> None:
        super().__init__(config)  # VisionLanguageModelBase, then Gemma3ForCausalLM(text_config)
        self.vision_tower = SiglipVisionTransformer(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)

    def embed_images(self, images: list[ProcessedImage]) -> list[torch.Tensor]:
        """One ``[num_tokens, hidden]`` tensor per image, in order: its placeholder's rows.

        Each image's ``pixel_values`` is ``[3, S, S]`` and its ``token_ids`` the placeholder's
        tokens, ``mm_tokens_per_image`` of them the image token. The images go through the
        tower as one batch.

        Raises:
            ValueError: an image without ``token_ids``, or whose image tokens and features
                differ in number.
        """
        if not images:
            return []
        if any(image.token_ids is None for image in images):
            raise ValueError("Gemma 3 images need their prompt token_ids (its processor's).")
        weight = self.multi_modal_projector.mm_input_projection_weight
        pixels = torch.stack([image.pixel_values for image in images])
        pixels = pixels.to(device=weight.device, dtype=weight.dtype)
        features = self.multi_modal_projector(self.vision_tower(pixels))
        features = features.reshape(-1, features.shape[-1])  # [images * tokens, hidden]
        token_ids = torch.tensor([t for image in images for t in image.token_ids])
        token_ids = token_ids.to(features.device)
        is_image = token_ids == self.image_token_id
        if int(is_image.sum()) != features.shape[0]:
            raise ValueError(
                f"{int(is_image.sum())} image tokens for {features.shape[0]} features."
            )
        # The image token may lie outside the vocabulary (HF then embeds id 0): its rows are
        # replaced anyway.
        text_ids = torch.where(is_image, torch.zeros_like(token_ids), token_ids)
        embeddings = self.get_input_embeddings(text_ids).to(features.dtype)
        embeddings[is_image] = features
        return list(embeddings.split([image.num_tokens for image in images]))
