"""The weightless checkpoint folder of a Gemma 3 architecture (``architectures.ARCHITECTURES``
entries of ``model_type`` "gemma3"), for ``load_format="dummy"``.

As ``architectures.write_architecture`` does for Qwen2-VL, but with what Gemma 3 needs: the
small tokenizer with Gemma's special and image tokens (``mm_serve.checkpoint.dummy_processors``;
the config's token ids are its ids, ``vocab_size`` the published one) and google/gemma-3-4b-it's
processor settings: ``Gemma3ImageProcessor`` at the tower's size (896 x 896, bilinear,
mean and std 0.5, no pan-and-scan) and 256 image tokens per image.
"""

from __future__ import annotations

import os
from typing import Any


def write_gemma3_architecture(values: dict[str, Any], folder: str | os.PathLike) -> str:
    """Write ``config.json``, the processor files, ``generation_config.json`` and the
    tokenizer of the Gemma 3 architecture ``values`` into ``folder``; returns its path."""
    from transformers import Gemma3Config, GenerationConfig

    from mm_serve.checkpoint.dummy_processors import gemma3_processor, gemma3_tokenizer

    tokenizer = gemma3_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    eos = [tokenizer.eos_token_id, ids("<end_of_turn>")]
    token_ids = {"bos_token_id": tokenizer.bos_token_id, "pad_token_id": tokenizer.pad_token_id}
    values = dict(values)
    values.pop("model_type")
    text = {**values.pop("text_config"), **token_ids, "eos_token_id": eos}
    config = Gemma3Config(
        text_config=text,
        boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"),
        **values,
    )
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    image_size = config.vision_config.image_size
    processor = gemma3_processor(tokenizer, image_size, config.mm_tokens_per_image)
    processor.save_pretrained(folder)
    GenerationConfig(eos_token_id=eos, **token_ids).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
