"""The shared half of the VLM classes: a vision tower in front of our ``LlamaForCausalLM``,
built from the HF config's ``text_config``, and the loading of both from one checkpoint."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from mm_serve.encoders.base import ProcessedImage
from mm_serve.encoders.qwen2_vl_processor import normalize_patches
from mm_serve.models.llama import LlamaForCausalLM


def tiles_on_device(images: list[ProcessedImage], device: torch.device) -> torch.Tensor:
    """The images' tiles concatenated on ``device``, float32 ``[sum of tiles, 3, S, S]``:
    uint8 tiles normalised there with their ``pixel_mean``/``pixel_std`` (the same float32
    operations as on the host), float32 tiles as they are."""
    tiles = []
    for image in images:
        pixels = image.pixel_values.to(device)
        if pixels.dtype == torch.uint8:
            pixels = normalize_patches(pixels, image.pixel_mean, image.pixel_std)
        tiles.append(pixels.to(torch.float32))
    return torch.cat(tiles)


def load_tower_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> str | None:
    """Copy a vision tensor into ``model``'s parameter ``name`` (plain, unsharded copy), or,
    when a module on its path has ``load_hf_tensor`` (a layout of its own, e.g. merged
    projections), hand it the tensor.

    Returns the name of the parameter written, or None, copying nothing, if there is no such
    parameter; raises ``ValueError`` naming the tensor if the shapes differ.
    """
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            module = model.get_submodule(".".join(parts[:cut]))
        except AttributeError:
            continue
        if hasattr(module, "load_hf_tensor"):
            written = module.load_hf_tensor(".".join(parts[cut:]), tensor)
            if written is not None:
                return ".".join(parts[:cut] + [written])
    try:
        param = model.get_parameter(name)
    except AttributeError:
        return None
    if param.shape != tensor.shape:
        raise ValueError(
            f"Cannot load {name!r}: shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
        )
    param.data.copy_(tensor)
    return name


# A LLaVA-style checkpoint's names (``vision_tower`` + ``multi_modal_projector`` + the LM) ->
# ours: as transformers 5 saves them (``model.``), and as the hub's older files have them
# (``language_model.model.``, ``language_model.lm_head.``). LLaVA, InternVL, LLaVA-OneVision.
LLAVA_STYLE_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


class VisionLanguageModelBase(LlamaForCausalLM):
    """A ``VisionLanguageModel`` (``models.interface``) of the HF VLM ``config``, with the LM
    interface of ``LlamaForCausalLM`` (``get_input_embeddings``, ``forward`` with positions
    ``[T]`` unless ``uses_mrope``, ``compute_logits``, ``attention_layers``, ``bind_kv_cache``).
    Subclasses add ``embed_images`` and set ``PREFIXES`` (checkpoint name prefix -> ours, first
    match wins); ``load_tower_tensor`` loads our names outside the LM's (``model.``,
    ``lm_head.``)."""

    PREFIXES: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: Any) -> None:
        super().__init__(config.text_config)
        # transformers 5 keeps a VLM's tie_word_embeddings on the outer config, not in
        # text_config: apply it to the LM built from text_config.
        if getattr(config, "tie_word_embeddings", False) and not self.tie_word_embeddings:
            self.tie_word_embeddings = True
            self.lm_head.weight = self.model.embed_tokens.weight
        self.config = config
        self.image_token_id: int = config.image_token_id

    def rename(self, ckpt_name: str) -> str:
        """Checkpoint tensor name -> our parameter name (unknown names are returned as is)."""
        for old, new in self.PREFIXES:
            if ckpt_name.startswith(old):
                return new + ckpt_name[len(old) :]
        return ckpt_name

    def param_name(self, ckpt_name: str) -> str:
        return super().param_name(self.rename(ckpt_name))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the vision tensors here and pass the LM's to ``LlamaForCausalLM.load_weights``.

        Returns the fully loaded parameter names; raises ``ValueError`` for a tensor of the
        wrong shape. Tensors matching no parameter are skipped with a warning.
        """
        loaded: set[str] = set()

        def language_model_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for ckpt_name, tensor in weights:
                name = self.rename(ckpt_name)
                vision = not name.startswith(("model.", "lm_head."))
                written = load_tower_tensor(self, name, tensor) if vision else None
                if written is not None:
                    loaded.add(written)
                else:
                    yield name, tensor  # the LM's loader skips unknown names with a warning

        return loaded | super().load_weights(language_model_weights())
