"""InternVL3: an InternViT tower over an image's tiles, a pixel-shuffle MLP projector, and a
Qwen2 decoder (our ``LlamaForCausalLM``, q/k/v biases, 1-D RoPE).

An image is ``[num_tiles, 3, tile, tile]`` pixels (``encoders.internvl_processor``: tiles, then
the thumbnail); each tile gives ``image_seq_len = (tile / patch)**2 * downsample_ratio**2``
rows. The placeholder covers ``<img>``, the image tokens and ``</img>``; ``embed_images``
returns a row per token (the tags' embeddings around the tile features), so a chunk may cut it
anywhere.

Parameter names: ``vision_tower.*``, ``multi_modal_projector.*``, ``model.*``, ``lm_head.*``.
Accepted: what transformers saves (``language_model.model.*``, ``language_model.lm_head.*``)
and its in-memory names (``model.*`` prefixes)."""

from __future__ import annotations

from typing import Any

import torch

from mm_serve.encoders.base import ProcessedImage
from mm_serve.encoders.internvl import InternVisionModel, InternVLMultiModalProjector
from mm_serve.models.vlm import LLAVA_STYLE_PREFIXES, VisionLanguageModelBase, tiles_on_device


class InternVLForConditionalGeneration(VisionLanguageModelBase):
    """InternVL3: ``vision_tower`` + ``multi_modal_projector`` + the Qwen2 LM (1-D RoPE);
    ``config`` is the HF ``InternVLConfig``.

    Raises ``ValueError`` (``__init__``) for a list ``vision_feature_layer`` (HF indexes its
    hidden states with it, which only an int can do) or the settings the tower and projector
    reject.
    """

    PREFIXES = LLAVA_STYLE_PREFIXES

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        if not isinstance(config.vision_feature_layer, int):
            raise ValueError(
                f"InternVL takes one vision_feature_layer, got {config.vision_feature_layer!r}."
            )
        self.vision_tower = InternVisionModel(config.vision_config, config.vision_feature_layer)
        self.multi_modal_projector = InternVLMultiModalProjector(config)

    def embed_tiles(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[num_tiles, 3, S, S] -> [num_tiles, image_seq_len, text_hidden]``."""
        weight = self.multi_modal_projector.linear_1.weight
        pixel_values = pixel_values.to(device=weight.device, dtype=weight.dtype)
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def embed_images(self, images: list[ProcessedImage]) -> list[torch.Tensor]:
        """One ``[num_tokens, hidden]`` tensor per image, in order: its placeholder's rows.

        Each image's ``pixel_values`` is ``[num_tiles, 3, S, S]`` (float32, or uint8 tiles
        that are normalised on the device, ``tiles_on_device``) and its ``token_ids`` the
        ``num_tokens`` prompt tokens of its placeholder: ``<img>``, ``num_tiles *
        image_seq_len`` image tokens, ``</img>``. The tiles of all images go through the
        tower as one batch.

        Raises:
            ValueError: an image without ``token_ids``, or whose image tokens and tile
                features differ in number or are not between two other tokens.
        """
        if not images:
            return []
        device = self.multi_modal_projector.linear_1.weight.device
        features = self.embed_tiles(tiles_on_device(images, device))
        per_image = features.split([len(image.pixel_values) for image in images])
        return [
            self._placeholder_rows(image, tiles.flatten(0, 1))  # [tiles * image_seq_len, hidden]
            for image, tiles in zip(images, per_image, strict=True)
        ]

    def _placeholder_rows(self, image: ProcessedImage, features: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, hidden]``: the embeddings of the image's first and last token (``<img>``
        and ``</img>``) around its tile features ``[num_tokens - 2, hidden]``."""
        token_ids = image.token_ids
        if token_ids is None:
            raise ValueError("InternVL images need their prompt token_ids (its processor's).")
        inner = token_ids[1:-1]
        if len(inner) != features.shape[0] or inner.count(self.image_token_id) != len(inner):
            raise ValueError(
                f"An image of {features.shape[0]} tile features has {len(token_ids)} prompt "
                "tokens; expected <img>, one image token per feature, </img>."
            )
        ends = torch.tensor([token_ids[0], token_ids[-1]], device=features.device)
        start, end = self.get_input_embeddings(ends).to(features.dtype)
        return torch.cat([start[None], features, end[None]])
