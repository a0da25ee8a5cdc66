"""A tiny Qwen3-VL checkpoint for tests, written by transformers' ``save_pretrained``.

Text: the Qwen2-VL tiny checkpoint's tokenizer and chat template (``vlm_tokenizer``), a Qwen3
LM of 3 layers (hidden 64, 4 heads of 32, 2 KV heads, q/k norms) with interleaved M-RoPE over
16 frequencies split 6:5:5 (the real 24:20:20 in small), tied embeddings (as Qwen3-VL-2B).
Vision: a tower of width 32 and depth 3 on 16-pixel patches, merge 2, a 6 x 6 learned position
grid (interpolated up and down to the images' grids) and DeepStack features from blocks 0 and 1
(added after LM layers 0 and 1; layer 2 gets none). The processor is transformers'
``Qwen2VLImageProcessor`` with Qwen3-VL's settings (patch 16, mean and std 0.5) and a small
pixel budget: 4 to 64 image tokens of 32 x 32 pixels.
"""

from __future__ import annotations

import os
from typing import Any

from mm_serve._compat import ensure_torchvision_importable
from mm_serve.testing.family_checkpoint import random_model, save_checkpoint

QWEN3_VL_PATCH = 16
QWEN3_VL_MIN_PIXELS = (2 * QWEN3_VL_PATCH) ** 2 * 4
QWEN3_VL_MAX_PIXELS = (2 * QWEN3_VL_PATCH) ** 2 * 64
# Qwen3-VL's preprocessor_config.json settings but the pixel budget.
QWEN3_VL_IMAGE_SETTINGS: dict[str, Any] = {
    "patch_size": QWEN3_VL_PATCH,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
_TEXT = dict(
    num_hidden_layers=3,
    head_dim=32,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
    },
)
_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    depth=3,
    patch_size=QWEN3_VL_PATCH,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=36,
    deepstack_visual_indexes=[0, 1],
    initializer_range=0.05,  # as the Qwen2-VL tiny tower: image rows about as large as tokens
)


def _config(text: dict[str, Any], ids: dict[str, Any]) -> Any:
    from transformers import Qwen3VLConfig

    vision = {**_VISION, "out_hidden_size": text["hidden_size"]}
    return Qwen3VLConfig(
        text_config={**text, **_TEXT},
        vision_config=vision,
        tie_word_embeddings=True,  # as Qwen3-VL-2B
        architectures=["Qwen3VLForConditionalGeneration"],
        **ids,
    )


def _processor(tokenizer: Any, chat_template: str) -> Any:
    ensure_torchvision_importable()
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    size = {"shortest_edge": QWEN3_VL_MIN_PIXELS, "longest_edge": QWEN3_VL_MAX_PIXELS}
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, **QWEN3_VL_IMAGE_SETTINGS),
        video_processor=Qwen3VLVideoProcessor(size=size, **QWEN3_VL_IMAGE_SETTINGS),
        tokenizer=tokenizer,
        chat_template=chat_template,
    )


def build_tiny_qwen3_vl_checkpoint(
    path: str | os.PathLike,
    tokenizer: Any,
    text: dict[str, Any],
    ids: dict[str, Any],
    seed: int,
) -> str:
    """Write the tiny Qwen3-VL checkpoint to ``path``: ``tokenizer`` (with its chat template),
    ``text`` (the tiny text sizes and token ids, which ``_TEXT`` completes) and ``ids`` (the
    image, video and vision start/end token ids). Returns ``path``."""
    from transformers import Qwen3VLForConditionalGeneration

    model = random_model(Qwen3VLForConditionalGeneration, _config(text, ids), seed)
    return save_checkpoint(path, model, _processor(tokenizer, tokenizer.chat_template))
