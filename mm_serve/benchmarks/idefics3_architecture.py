"""Idefics3 / SmolVLM architectures for dummy-weight benchmarks: their published config values
(``ARCHITECTURES``, merged into ``architectures.ARCHITECTURES``) and the weightless checkpoint
folder (``write_idefics3_architecture``).

As ``architectures.write_architecture`` does for Qwen2-VL, with what Idefics3 needs: the
small tokenizer with Idefics3's image, tile-tag and end-of-utterance tokens
(``mm_serve.checkpoint.dummy_processors``; the config's token ids are its ids, ``vocab_size`` the
published one) and ``Idefics3Processor`` with the published tiling: tiles of the tower's
``image_size``, images resized to at most four tiles per side, ``image_seq_len`` tokens per
tile (``(image_size / patch_size)**2 / scale_factor**2``).
"""

from __future__ import annotations

import os
from typing import Any

# HuggingFaceTB/SmolVLM-256M-Instruct and SmolVLM-Instruct (2.2B) config.json, minus the token
# ids: a SmolLM2 LM (135M, 1.7B) and a SigLIP tower (93M on 512-pixel tiles of 16-pixel
# patches; so400m on 384-pixel tiles of 14), pixel-shuffled by 4 and 3.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "smolvlm-256m": {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "scale_factor": 4,
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "llama",
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "vocab_size": 49280,
            "rope_theta": 100000.0,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-05,
            "tie_word_embeddings": True,
        },
        "vision_config": {
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "image_size": 512,
            "patch_size": 16,
        },
    },
    "smolvlm-2.2b": {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "scale_factor": 3,
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "llama",
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 24,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "vocab_size": 49155,
            "rope_theta": 273768.0,
            "max_position_embeddings": 16384,
            "rms_norm_eps": 1e-05,
            "tie_word_embeddings": False,
        },
        "vision_config": {
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_hidden_layers": 27,
            "num_attention_heads": 16,
            "image_size": 384,
            "patch_size": 14,
        },
    },
}


def write_idefics3_architecture(values: dict[str, Any], folder: str | os.PathLike) -> str:
    """Write ``config.json``, the processor files, ``generation_config.json`` and the
    tokenizer of the Idefics3 architecture ``values`` into ``folder``; returns its path."""
    from transformers import GenerationConfig, Idefics3Config

    from mm_serve.checkpoint.dummy_processors import idefics3_processor, idefics3_tokenizer

    tokenizer = idefics3_tokenizer()
    eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_utterance>")]
    token_ids = {"bos_token_id": tokenizer.bos_token_id, "pad_token_id": tokenizer.pad_token_id}
    values = dict(values)
    values.pop("model_type")
    text = {**values.pop("text_config"), **token_ids, "eos_token_id": eos}
    config = Idefics3Config(
        text_config=text, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), **values
    )
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    vision = config.vision_config
    tile = vision.image_size
    image_seq_len = (tile // vision.patch_size) ** 2 // config.scale_factor**2
    idefics3_processor(tokenizer, tile, 4 * tile, image_seq_len).save_pretrained(folder)
    GenerationConfig(eos_token_id=eos, **token_ids).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
