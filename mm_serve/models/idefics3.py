"""Idefics3 / SmolVLM: a SigLIP tower over an image's tiles, a pixel-shuffle connector, and a
Llama decoder (our ``LlamaForCausalLM``, 1-D RoPE).

An image is ``[num_tiles, 3, tile, tile]`` pixels (``encoders.idefics3_processor``); each tile
gives ``image_seq_len = (tile / patch)**2 / scale**2`` rows. The placeholder covers the whole
expansion (tags, newlines, ``<image>`` tokens); ``embed_images`` returns a row per token (a
tag's or newline's embedding, or the tile features at ``<image>``, as HF's ``inputs_merger``),
so a chunk may cut it anywhere.

Parameter names: ``vision_model.*``, ``connector.modality_projection.proj.weight``,
``model.*``, ``lm_head.*``; checkpoints (hub and transformers 5): ``model.vision_model.*``,
``model.connector.*``, ``model.text_model.*``, ``lm_head.*``."""

from __future__ import annotations

from typing import Any

import torch

from mm_serve.encoders.base import ProcessedImage
from mm_serve.encoders.siglip import Idefics3Connector, SiglipVisionTransformer
from mm_serve.models.vlm import VisionLanguageModelBase, tiles_on_device


class Idefics3ForConditionalGeneration(VisionLanguageModelBase):
    """Idefics3: ``vision_model`` + ``connector`` + the Llama LM (1-D RoPE); ``config`` is
    the HF ``Idefics3Config``."""

    PREFIXES = (
        ("model.vision_model.", "vision_model."),
        ("model.connector.", "connector."),
        ("model.text_model.", "model."),
    )

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.vision_model = SiglipVisionTransformer(config.vision_config)
        self.connector = Idefics3Connector(config)

    def embed_tiles(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[num_tiles, 3, S, S] -> [num_tiles, image_seq_len, text_hidden]``."""
        weight = self.connector.modality_projection.proj.weight
        pixel_values = pixel_values.to(device=weight.device, dtype=weight.dtype)
        return self.connector(self.vision_model(pixel_values))

    def embed_images(self, images: list[ProcessedImage]) -> list[torch.Tensor]:
        """One ``[num_tokens, hidden]`` tensor per image, in order: its placeholder's rows.

        Each image's ``pixel_values`` is ``[num_tiles, 3, S, S]`` (float32, or uint8 tiles
        that are normalised on the device, ``tiles_on_device``) and its ``token_ids`` the
        ``num_tokens`` prompt tokens of its placeholder, ``num_tiles * image_seq_len`` of them
        the image token. The tiles of all images go through the tower as one batch.

        Raises:
            ValueError: an image without ``token_ids``, or whose image tokens and tile
                features differ in number.
        """
        if not images:
            return []
        if any(image.token_ids is None for image in images):
            raise ValueError("Idefics3 images need their prompt token_ids (its processor's).")
        weight = self.connector.modality_projection.proj.weight
        features = self.embed_tiles(tiles_on_device(images, weight.device))
        features = features.reshape(-1, features.shape[-1])  # [all tiles' rows, hidden]
        device = features.device
        token_ids = torch.tensor([t for image in images for t in image.token_ids], device=device)
        is_image = token_ids == self.image_token_id
        if int(is_image.sum()) != features.shape[0]:
            raise ValueError(
                f"{int(is_image.sum())} image tokens for {features.shape[0]} tile features."
            )
        embeddings = self.get_input_embeddings(token_ids).to(features.dtype)
        embeddings[is_image] = features
        return list(embeddings.split([image.num_tokens for image in images]))
