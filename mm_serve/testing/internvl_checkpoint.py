"""A tiny InternVL3 checkpoint for tests, written by transformers' ``save_pretrained``.

Text: the Qwen2 text builder's tokenizer plus InternVL's image tokens (``<img>``, ``</img>``,
``<IMG_CONTEXT>``, ``<video>``, named as the tokenizer's ``start_image_token``,
``end_image_token``, ``context_image_token`` and ``video_token``) and an InternVL3-style chat
template, over a Qwen2 LM. Vision: an InternViT tower of width 32 on 32 x 32 tiles of 8-pixel
patches (4 x 4 patches plus the class token), pixel-shuffled by ``downsample_ratio`` 0.5 into
4 image tokens per tile. The processor tiles with GotOcr2's defaults (1 to 12 tiles and the
thumbnail), so an image takes 1 to 13 tiles.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from mm_serve._compat import ensure_torchvision_importable
from mm_serve.testing.checkpoints import build_tokenizer
from mm_serve.testing.family_checkpoint import (
    TINY_VISION,
    random_model,
    save_checkpoint,
    text_token_ids,
)

INTERNVL_TILE, INTERNVL_PATCH = 32, 8
INTERNVL_DOWNSAMPLE = 0.5
INTERNVL_IMAGE_SEQ_LEN = int((INTERNVL_TILE // INTERNVL_PATCH) ** 2 * INTERNVL_DOWNSAMPLE**2)
# The tokenizer's named image tokens, as InternVL3-*-hf's tokenizer_config.json names them.
INTERNVL_IMAGE_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}

# As InternVL3-*-hf's template, shortened (no system prompt): an image part renders as
# "<IMG_CONTEXT>\n", which the processor expands to <img>, the tiles' tokens and </img>.
INTERNVL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{- '<IMG_CONTEXT>\\n' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def internvl_tokenizer() -> Any:
    """The Qwen2 text builder's tokenizer plus InternVL's named image tokens and chat template."""
    base = build_tokenizer("qwen2")
    base.add_tokens(list(INTERNVL_IMAGE_TOKENS.values()), special_tokens=True)
    # Named special tokens are set when a tokenizer is made: make it again around the same
    # backend, as from_pretrained does from tokenizer_config.json's "extra_special_tokens".
    return type(base)(
        tokenizer_object=base.backend_tokenizer,
        eos_token=base.eos_token,
        pad_token=base.pad_token,
        extra_special_tokens=dict(INTERNVL_IMAGE_TOKENS),
        chat_template=INTERNVL_CHAT_TEMPLATE,
    )


def internvl_processor(tokenizer: Any, tile: int, image_seq_length: int) -> Any:
    """transformers' ``InternVLProcessor``: GotOcr2's image processor with InternVL3's settings
    (ImageNet statistics, bicubic, ``tile x tile``, GotOcr2's default 1 to 12 tiles)."""
    ensure_torchvision_importable()
    from transformers import GotOcr2ImageProcessor, InternVLProcessor, InternVLVideoProcessor

    settings = dict(
        size={"height": tile, "width": tile},
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    )
    return InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(**settings),
        video_processor=InternVLVideoProcessor(**settings),
        tokenizer=tokenizer,
        image_seq_length=image_seq_length,
        chat_template=INTERNVL_CHAT_TEMPLATE,
    )


def _config(tokenizer: Any, text: dict[str, Any]) -> Any:
    from transformers import InternVLConfig

    vision = dict(
        **TINY_VISION,
        attention_bias=True,  # as InternViT-300M
        image_size=INTERNVL_TILE,
        patch_size=INTERNVL_PATCH,
        layer_norm_eps=1e-6,
    )
    return InternVLConfig(
        text_config={**text, "model_type": "qwen2", "rope_theta": 1000000.0},
        vision_config=vision,
        downsample_ratio=INTERNVL_DOWNSAMPLE,
        image_seq_length=INTERNVL_IMAGE_SEQ_LEN,
        image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"),
        architectures=["InternVLForConditionalGeneration"],
    )


@torch.no_grad()
def _randomise_vision(model: Any, seed: int) -> None:
    """HF inits the class token and the position embeddings to zero and the layer scales to a
    constant: make them random so that loading bugs cannot hide; the projector at 0.05 (not
    the text std, 0.3) keeps image embeddings about as large as token embeddings."""
    gen = torch.Generator().manual_seed(seed + 2)
    embeddings = model.model.vision_tower.embeddings
    for param in (embeddings.cls_token, embeddings.position_embeddings):
        param.copy_(0.5 * torch.randn(param.shape, generator=gen))
    for layer in model.model.vision_tower.encoder.layer:
        for scale in (layer.lambda_1, layer.lambda_2):
            scale.copy_(0.1 + 0.5 * torch.rand(scale.shape, generator=gen))
    projector = model.model.multi_modal_projector
    for linear in (projector.linear_1, projector.linear_2):
        linear.weight.normal_(0.0, 0.05, generator=gen)


def build_tiny_internvl_checkpoint(
    path: str | os.PathLike, text: dict[str, Any], seed: int, vocab_size: int | None
) -> str:
    """Write the tiny InternVL3 checkpoint to ``path`` with the text config ``text`` (tiny
    sizes, without the token ids, which come from the tokenizer). Returns ``path``.

    Raises:
        ValueError: ``vocab_size`` below the tokenizer's length.
    """
    from transformers import InternVLForConditionalGeneration

    tokenizer = internvl_tokenizer()
    config = _config(tokenizer, {**text, **text_token_ids(tokenizer, vocab_size)})
    model = random_model(InternVLForConditionalGeneration, config, seed)
    _randomise_vision(model, seed)
    processor = internvl_processor(tokenizer, INTERNVL_TILE, INTERNVL_IMAGE_SEQ_LEN)
    return save_checkpoint(path, model, processor)
