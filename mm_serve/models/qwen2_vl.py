"""Qwen2-VL and Qwen2.5-VL: a ViT (``encoders``) in front of a Qwen2 decoder with M-RoPE.

The language model is our ``LlamaForCausalLM`` on the HF ``text_config``; its rope dict has
``mrope_section``, so ``get_rope`` gives it ``MRotaryEmbedding`` and ``forward`` takes
positions ``[3, T]`` (``mm_serve.models.mrope.get_mrope_input_positions`` makes them).
The model runner drives it as a text model plus two calls:

1. ``embed_images(images)`` -> one ``[num_tokens, hidden]`` tensor per image;
2. it writes those rows into ``get_input_embeddings(input_ids)`` at the image-token positions
   and calls ``forward(None, positions, attn_metadata, inputs_embeds)``.

Parameter names: ``visual.*`` (the tower's, as HF's), ``model.*`` and ``lm_head.*`` (the LM's).
Checkpoints name the tensors either so (Qwen/Qwen2-VL-*, and what transformers 5 saves) or
``model.visual.*``, ``model.language_model.*``, ``lm_head.*`` (transformers 5 in memory).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mm_serve.encoders.base import ProcessedImage
from mm_serve.encoders.qwen2_5_vl import Qwen2_5_VisionTransformer
from mm_serve.encoders.qwen2_vl import Qwen2VisionTransformer, check_grid
from mm_serve.encoders.qwen2_vl_processor import normalize_patches, patchify
from mm_serve.models.vlm import VisionLanguageModelBase


def pixels_on_device(
    images: list[ProcessedImage], device: torch.device, vision_config: Any
) -> torch.Tensor:
    """The images' (and videos') patches concatenated on ``device``, float32 ``[sum of rows,
    C * K]``.

    uint8 items (a resized image ``[C, H, W]`` or video frames ``[T, C, H, W]``, see
    ``ProcessedImage``) are gathered into one pinned host buffer, copied without blocking,
    then patchified and normalised on the device; float32 patches are copied as they are.
    ``vision_config`` gives ``patch_size``, ``temporal_patch_size`` and ``spatial_merge_size``.
    """
    pixels = [image.pixel_values for image in images]
    if any(p.dtype != torch.uint8 for p in pixels):  # final pixels, or a mix: one at a time
        if len(images) > 1:
            return torch.cat([pixels_on_device([i], device, vision_config) for i in images])
        return pixels[0].to(device=device, dtype=torch.float32)
    pinned = device.type == "cuda"
    sizes = [p.numel() for p in pixels]
    host = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=pinned)
    torch.cat([p.reshape(-1) for p in pixels], out=host)
    flat = host.to(device, non_blocking=pinned)
    c = vision_config
    patches = [
        patchify(chunk.view(p.shape), c.patch_size, c.temporal_patch_size, c.spatial_merge_size)
        for chunk, p in zip(flat.split(sizes), pixels, strict=True)
    ]
    return normalize_patches(torch.cat(patches), images[0].pixel_mean, images[0].pixel_std)


class Qwen2VLForConditionalGeneration(VisionLanguageModelBase):
    """Qwen2-VL: ``visual`` (``Qwen2VisionTransformer``) + the Qwen2 LM with M-RoPE.

    ``config`` is the HF ``Qwen2VLConfig``. Inherits the LM interface (``get_input_embeddings``,
    ``forward``, ``compute_logits``, ``attention_layers``, ``bind_kv_cache``); ``forward``
    takes positions ``[3, T]`` (or ``[T]`` when the three axes are equal, e.g. decode).
    """

    uses_mrope = True
    PREFIXES = (
        ("model.visual.", "visual."),
        ("model.language_model.", "model."),
        ("visual.", "visual."),
        ("model.", "model."),
        ("lm_head.", "lm_head."),
    )
    tower_class: type[Qwen2VisionTransformer] = Qwen2VisionTransformer

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.spatial_merge_size: int = config.vision_config.spatial_merge_size
        self.visual = self.tower_class(config.vision_config)
        # ``(pixel_values, grids) -> embeddings`` in place of ``visual``'s forward: the model
        # runner sets it to run the tower through CUDA graphs (``worker.tower_graphs``) and,
        # under TP, to split the images over the ranks (``worker.encoder_dp``).
        self.tower_runner: Callable[[torch.Tensor, list[list[int]]], torch.Tensor] | None = None

    def embed_images(self, images: list[ProcessedImage]) -> list[torch.Tensor]:
        """One ``[num_tokens, hidden]`` tensor per image or video, in order, from one tower
        call (HF's ``get_image_features`` and ``get_video_features`` alike).

        Each item's ``pixel_values`` is ``[t * h * w, C * T * P * P]`` (or uint8 ``[C, H, W]``
        or ``[frames, C, H, W]``, see ``pixels_on_device``) with ``image_grid_thw = (t, h, w)``
        in patches; it gives ``t * h * w // merge**2`` rows. The tower attends within each
        temporal patch of ``h * w`` patches.
        """
        if not images:
            return []
        weight = self.visual.patch_embed.proj.weight
        pixel_values = pixels_on_device(images, weight.device, self.config.vision_config)
        pixel_values = pixel_values.to(weight.dtype)
        grids = [tuple(image.image_grid_thw) for image in images]
        grid_thw = torch.tensor(grids, dtype=torch.long)  # stays on the host: read as a list
        if self.tower_runner is None:
            embeddings = self.visual(pixel_values, grid_thw)  # [sum of tokens, hidden]
        else:
            grids = check_grid(pixel_values, grid_thw, self.spatial_merge_size)
            embeddings = self.tower_runner(pixel_values, grids)
        sizes = [t * h * w // self.spatial_merge_size**2 for t, h, w in grids]
        return list(embeddings.split(sizes))


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: the same model with the windowed-attention tower
    (``Qwen2_5_VisionTransformer``, SwiGLU MLP, RMSNorm); ``config`` is ``Qwen2_5_VLConfig``."""

    tower_class = Qwen2_5_VisionTransformer
