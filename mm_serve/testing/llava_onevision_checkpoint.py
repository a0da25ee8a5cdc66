"""A tiny LLaVA-OneVision checkpoint for tests, written by transformers' ``save_pretrained``.

Text: a Qwen2 LM (the Qwen2 text builder's tokenizer plus ``<image>`` and ``<video>``, the
chat template of the llava-hf conversion, tied embeddings as the 0.5B). Vision: a SigLIP tower
of width 32 on 32 x 32 tiles of 8-pixel patches (4 x 4 = 16 features per tile, all kept: the
"full" select strategy, the last layer), the 2-layer projector and ``image_newline``. The
processor's grid pinpoints are small multiples of the tile (1 x 1 up to 2 x 2 and 1 x 3 /
3 x 1 tiles), so that images of different shapes pick different grids, and
``anyres_max_2`` makes the larger grids downsample their features (as ``anyres_max_9`` does
for the real models' 6 x 6 grids).
"""

from __future__ import annotations

import os
from typing import Any

from mm_serve._compat import ensure_torchvision_importable
from mm_serve.testing.family_checkpoint import (
    TINY_VISION,
    family_tokenizer,
    random_model,
    save_checkpoint,
    shrink_projector,
    text_token_ids,
)

ONEVISION_TILE, ONEVISION_PATCH = 32, 8
ONEVISION_TILE_TOKENS = (ONEVISION_TILE // ONEVISION_PATCH) ** 2
ONEVISION_PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64], [32, 96], [96, 32]]
ONEVISION_ASPECT_RATIO = "anyres_max_2"
ONEVISION_SPECIALS = ["<image>", "<video>"]

# The llava-hf conversion's template (images first, then videos, then the text of a message),
# also rendering OpenAI-style image_url parts as an image.
ONEVISION_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{- '<image>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def onevision_tokenizer() -> Any:
    """The Qwen2 text builder's tokenizer plus ``<image>``, ``<video>`` and the template."""
    return family_tokenizer("qwen2", ONEVISION_SPECIALS, ONEVISION_CHAT_TEMPLATE)


def _config(tokenizer: Any, text: dict[str, Any]) -> Any:
    from transformers import LlavaOnevisionConfig

    vision = dict(
        **TINY_VISION,
        model_type="siglip_vision_model",
        image_size=ONEVISION_TILE,
        patch_size=ONEVISION_PATCH,
        vision_use_head=False,
    )
    ids = tokenizer.convert_tokens_to_ids
    return LlavaOnevisionConfig(
        text_config={**text, "model_type": "qwen2", "rope_theta": 1000000.0},
        vision_config=vision,
        image_token_index=ids("<image>"),
        video_token_index=ids("<video>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        image_grid_pinpoints=ONEVISION_PINPOINTS,
        vision_aspect_ratio=ONEVISION_ASPECT_RATIO,
        tie_word_embeddings=True,  # as the 0.5B
        architectures=["LlavaOnevisionForConditionalGeneration"],
    )


def onevision_processor(
    tokenizer: Any,
    tile: int = ONEVISION_TILE,
    pinpoints: list[list[int]] | None = None,
    num_image_tokens: int = ONEVISION_TILE_TOKENS,
    vision_aspect_ratio: str = ONEVISION_ASPECT_RATIO,
) -> Any:
    """transformers' ``LlavaOnevisionProcessor`` with ``tile x tile`` tiles, SigLIP's mean and
    std (0.5) and bicubic resizing, as the published checkpoints have it; by default the tiny
    checkpoint's settings."""
    ensure_torchvision_importable()
    from transformers import (
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    size = {"height": tile, "width": tile}
    half = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    image_processor = LlavaOnevisionImageProcessor(
        size=size, image_grid_pinpoints=pinpoints or ONEVISION_PINPOINTS, **half
    )
    return LlavaOnevisionProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=LlavaOnevisionVideoProcessor(size=size, **half),
        num_image_tokens=num_image_tokens,
        vision_feature_select_strategy="full",
        vision_aspect_ratio=vision_aspect_ratio,
        chat_template=ONEVISION_CHAT_TEMPLATE,
    )


def build_tiny_llava_onevision_checkpoint(
    path: str | os.PathLike, text: dict[str, Any], seed: int, vocab_size: int | None
) -> str:
    """Write the tiny LLaVA-OneVision checkpoint to ``path`` with the text config ``text``
    (tiny sizes, without the token ids, which come from the tokenizer). Returns ``path``.

    Raises:
        ValueError: ``vocab_size`` below the tokenizer's length.
    """
    from transformers import LlavaOnevisionForConditionalGeneration

    tokenizer = onevision_tokenizer()
    config = _config(tokenizer, {**text, **text_token_ids(tokenizer, vocab_size)})
    model = random_model(LlavaOnevisionForConditionalGeneration, config, seed)
    projector = model.model.multi_modal_projector
    shrink_projector(projector.linear_1, projector.linear_2)
    return save_checkpoint(path, model, onevision_processor(tokenizer))
