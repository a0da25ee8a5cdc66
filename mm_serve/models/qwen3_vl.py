"""Qwen3-VL (dense): a ViT with DeepStack (``encoders.qwen3_vl``) in front of a Qwen3 decoder
with interleaved M-RoPE.

The LM is our ``LlamaForCausalLM`` on the ``text_config`` (per-head q/k RMSNorm,
``MRotaryEmbedding`` with ``mrope_interleaved``); positions as HF ``Qwen3VLModel.get_rope_index``
(``models.mrope.get_mrope_input_positions``).

DeepStack (arXiv:2406.04334; HF ``Qwen3VLTextModel._deepstack_process``): the tower's features
from ``n = len(deepstack_visual_indexes)`` blocks are added to the hidden states at the image
tokens after layers ``0 .. n - 1``. They travel with the image's embeddings, one row per image
token:

- ``embed_images``: ``[num_tokens, (1 + n) * hidden]`` per image (the tower's output);
- ``get_input_embeddings``: ``[T, (1 + n) * hidden]``, the embeddings then zeros
  (``inputs_embeds_size`` says the width);
- ``forward`` splits ``inputs_embeds`` into the embeddings and ``[T, n, hidden]`` additions
  (zero for text tokens).

Parameter names: ``visual.*``, ``model.*``, ``lm_head.*``; checkpoints name them
``model.visual.*``, ``model.language_model.*``, ``lm_head.*``."""

from __future__ import annotations

from typing import Any

import torch

from mm_serve.encoders.base import ProcessedImage
from mm_serve.encoders.qwen3_vl import Qwen3VisionTransformer
from mm_serve.kernels.attention_metadata import AttentionMetadata
from mm_serve.models.layers.rotary import MRotaryEmbedding
from mm_serve.models.qwen2_vl import Qwen2VLForConditionalGeneration


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen3-VL: ``visual`` (``Qwen3VisionTransformer``) + the Qwen3 LM with interleaved M-RoPE
    and DeepStack; ``config`` is the HF ``Qwen3VLConfig``. ``embed_images`` and the tower's
    CUDA graphs (``tower_runner``) are Qwen2-VL's, a video's rows also cover the text among its
    video tokens; the module doc gives the embedding width.

    Raises:
        ValueError: the text config's rope parameters have no ``mrope_section``.
    """

    tower_class = Qwen3VisionTransformer

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        rotary = self.model.rotary_emb
        if not isinstance(rotary, MRotaryEmbedding):
            raise ValueError("Qwen3-VL needs mrope_section in the text config's rope_parameters.")
        # HF's Qwen3VLTextRotaryEmbedding interleaves whatever mrope_interleaved says; the one
        # module is shared by every layer.
        rotary.mrope_interleaved = True
        self.hidden_size: int = config.text_config.hidden_size
        self.num_deepstack = len(config.vision_config.deepstack_visual_indexes)
        self.inputs_embeds_size = (1 + self.num_deepstack) * self.hidden_size

    def embed_images(self, images: list[ProcessedImage]) -> list[torch.Tensor]:
        """One ``[num_tokens, (1 + num_deepstack) * hidden]`` tensor per image or video, in
        order (one tower call, Qwen2-VL's ``embed_images``). A video's placeholder holds its
        time texts and vision start/end tokens among the video tokens (``token_ids``,
        ``encoders.qwen3_vl_video_processor``): their rows are their token embeddings with zero
        DeepStack columns (``get_input_embeddings``), the video tokens' rows the tower's."""
        features = super().embed_images(images)
        return [
            self._with_text_rows(item, rows) for item, rows in zip(images, features, strict=True)
        ]

    def _with_text_rows(self, item: ProcessedImage, features: torch.Tensor) -> torch.Tensor:
        """``features`` ``[num_video_tokens, width]`` placed at the video tokens of
        ``item.token_ids``, the other rows embedded as text; ``features`` when it has none."""
        if item.token_ids is None:
            return features
        token_ids = torch.tensor(item.token_ids, device=features.device)
        rows = self.get_input_embeddings(token_ids).to(features.dtype)
        rows[token_ids == self.config.video_token_id] = features
        return rows

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T] -> [T, (1 + num_deepstack) * hidden]``: the token embeddings, then zeros (the
        DeepStack columns of a text token)."""
        embeds = self.model.embed_tokens(input_ids)
        extra = embeds.new_zeros(embeds.shape[0], self.inputs_embeds_size - self.hidden_size)
        return torch.cat([embeds, extra], dim=-1)

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [T]
        positions: torch.Tensor,  # [3, T], or [T] when the axes are equal
        attn_metadata: AttentionMetadata | None,
        inputs_embeds: torch.Tensor | None = None,  # [T, (1 + num_deepstack) * hidden]
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]``. From ``input_ids`` (decode, text): no
        DeepStack; from ``inputs_embeds`` (``get_input_embeddings`` with image rows written
        in): its DeepStack columns are added after the first layers."""
        if inputs_embeds is None:
            return self.model(input_ids, positions, attn_metadata)
        embeds, deepstack = inputs_embeds.split(
            [self.hidden_size, self.inputs_embeds_size - self.hidden_size], dim=-1
        )
        additions = deepstack.unflatten(-1, (self.num_deepstack, self.hidden_size))
        return self.model(None, positions, attn_metadata, embeds, additions)
