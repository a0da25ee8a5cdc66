"""A tiny Idefics3 (SmolVLM) checkpoint for tests, written by transformers' ``save_pretrained``.

Text: the Llama text builder's tokenizer plus Idefics3's image tokens (``<image>``,
``<fake_token_around_image>``, ``<global-img>``, ``<row_i_col_j>``, ``<end_of_utterance>``)
and a SmolVLM-style chat template. Vision: a SigLIP tower of width 32 on 48 x 48 tiles of
8-pixel patches (6 x 6 patches), pixel-shuffled by 2 into 9 image tokens per tile. The
processor resizes the longest edge to 144 (at most 3 x 3 tiles plus the global image).
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

IDEFICS3_TILE = 48  # the vision tower's image_size = the processor's max_image_size
IDEFICS3_LONGEST_EDGE = 3 * IDEFICS3_TILE
IDEFICS3_PATCH, IDEFICS3_SCALE = 8, 2
IDEFICS3_IMAGE_SEQ_LEN = (IDEFICS3_TILE // IDEFICS3_PATCH) ** 2 // IDEFICS3_SCALE**2
IDEFICS3_SPECIALS = [
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]

# As SmolVLM-Instruct's template, shortened: "<|im_start|>User:<image>Hi<end_of_utterance>\n
# Assistant:" (image parts render as <image>, which the processor expands).
IDEFICS3_CHAT_TEMPLATE = (
    "<|im_start|>{%- for message in messages -%}"
    "{{- message['role'] | capitalize -}}"
    "{%- if message['content'] is string -%}{{- ': ' + message['content'] -}}"
    "{%- else -%}{{- ':' if message['content'][0]['type'] == 'image' else ': ' -}}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{- '<image>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<end_of_utterance>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant:' -}}{%- endif -%}"
)


def idefics3_tokenizer() -> Any:
    """The Llama text builder's tokenizer plus Idefics3's special tokens and chat template."""
    return family_tokenizer("llama", IDEFICS3_SPECIALS, IDEFICS3_CHAT_TEMPLATE)


def _config(tokenizer: Any, text: dict[str, Any]) -> Any:
    from transformers import Idefics3Config

    vision = dict(**TINY_VISION, image_size=IDEFICS3_TILE, patch_size=IDEFICS3_PATCH)
    return Idefics3Config(
        text_config={**text, "model_type": "llama", "rope_theta": 100000.0},
        vision_config=vision,
        scale_factor=IDEFICS3_SCALE,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        architectures=["Idefics3ForConditionalGeneration"],
    )


def _processor(tokenizer: Any) -> Any:
    ensure_torchvision_importable()
    from transformers import Idefics3ImageProcessor, Idefics3Processor

    image_processor = Idefics3ImageProcessor(
        size={"longest_edge": IDEFICS3_LONGEST_EDGE},
        max_image_size={"longest_edge": IDEFICS3_TILE},
    )
    return Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=IDEFICS3_IMAGE_SEQ_LEN,
        chat_template=IDEFICS3_CHAT_TEMPLATE,
    )


def build_tiny_idefics3_checkpoint(
    path: str | os.PathLike, text: dict[str, Any], seed: int, vocab_size: int | None
) -> str:
    """Write the tiny Idefics3 checkpoint to ``path`` with the text config ``text`` (tiny
    Llama sizes, without the token ids, which come from the tokenizer). Returns ``path``.

    Raises:
        ValueError: ``vocab_size`` below the tokenizer's length.
    """
    from transformers import Idefics3ForConditionalGeneration

    tokenizer = idefics3_tokenizer()
    end_of_utterance = tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    ids = text_token_ids(tokenizer, vocab_size, [tokenizer.eos_token_id, end_of_utterance])
    config = _config(tokenizer, {**text, **ids})
    model = random_model(Idefics3ForConditionalGeneration, config, seed)
    shrink_projector(model.model.connector.modality_projection.proj)
    return save_checkpoint(path, model, _processor(tokenizer))
