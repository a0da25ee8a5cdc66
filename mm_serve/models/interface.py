"""What the engine calls on a model (``LlamaForCausalLM``: a ``LanguageModel``; the classes of
``models/vlm.py``: ``VisionLanguageModel``s)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch

from mm_serve.encoders.base import ProcessedImage
from mm_serve.kernels.attention_metadata import AttentionMetadata


@runtime_checkable
class LanguageModel(Protocol):
    """A decoder over the flattened batch of all scheduled tokens (no padding)."""

    # True: ``forward`` takes M-RoPE positions ``[3, T]`` (``models.mrope``), else ``[T]``.
    uses_mrope: bool
    # Width of ``inputs_embeds`` rows: ``hidden``, or more where the LM takes extra per-token
    # inputs beside the embeddings (Qwen3-VL: DeepStack features, ``models.qwen3_vl``).
    inputs_embeds_size: int
    # True: the image tokens of one image attend to each other in prefill (the model runner
    # sets ``AttentionMetadata.key_end``; the family's ``bidirectional_images``).
    bidirectional_images: bool

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors in; the names of the parameters now fully loaded."""
        ...

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T] -> [T, inputs_embeds_size]``: the token embeddings, then zeros in any extra
        columns (what a text token adds there)."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [T]
        positions: torch.Tensor,  # [T], or [3, T] with uses_mrope
        attn_metadata: AttentionMetadata | None,
        inputs_embeds: torch.Tensor | None = None,  # [T, inputs_embeds_size], replaces input_ids
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]``."""
        ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` in the model's dtype."""
        ...

    def bind_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        """One ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer."""
        ...


@runtime_checkable
class VisionLanguageModel(LanguageModel, Protocol):
    """A ``LanguageModel`` whose prompts hold images: ``image_token_id`` placeholder tokens
    whose embeddings ``embed_images`` replaces (the model runner writes its rows into
    ``get_input_embeddings(input_ids)`` and calls ``forward`` with ``inputs_embeds``)."""

    image_token_id: int

    def embed_images(self, images: list[ProcessedImage]) -> list[torch.Tensor]:
        """One ``[num_tokens, inputs_embeds_size]`` tensor per image, in order: the rows that
        replace its placeholder tokens' ``get_input_embeddings`` rows, whole, so any slice of
        them (a chunk's) carries everything the LM needs of those tokens."""
        ...
