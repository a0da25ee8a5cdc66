"""Published configs and weightless-folder writers of the families whose folders differ from
Qwen2-VL's: InternVL3, LLaVA-OneVision, Gemma 3 and Idefics3/SmolVLM (each its own image tokens,
small tokenizer from ``mm_serve.checkpoint.dummy_processors`` and processor), and Qwen3-VL's and
Qwen3-VL-MoE's configs (their folders are Qwen2-VL's with ``QWEN3_VL_PREPROCESSOR``).

``FAMILY_ARCHITECTURES`` (name -> config.json values, token ids left out) joins
``architectures.ARCHITECTURES``; ``FAMILY_WRITERS`` (by ``model_type``) is what
``architectures.write_architecture`` calls for them. The config's token ids are the small
tokenizer's; ``vocab_size`` stays the published one.
"""

from __future__ import annotations

import os
from typing import Any

# InternVL3-8B-hf / -2B-hf config.json (Hugging Face Hub, transformers-native): the
# InternViT-300M-448px-V2.5 tower (1025 tokens per 448x448 tile, 256 image tokens after the
# pixel shuffle) and a Qwen2.5 LM with InternVL3's dynamic RoPE scaling, minus the token ids.
_INTERNVIT_300M: dict[str, Any] = {
    "model_type": "internvl_vision",
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "attention_bias": True,
    "use_qk_norm": False,
    "hidden_act": "gelu",
    "norm_type": "layer_norm",
    "layer_norm_eps": 1e-06,
    "image_size": [448, 448],
    "patch_size": [14, 14],
    "layer_scale_init_value": 0.1,
    "use_absolute_position_embeddings": True,
    "use_mean_pooling": True,
    "use_mask_token": False,
}
_INTERNVL3_TEXT: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "num_hidden_layers": 28,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": {"factor": 2.0, "rope_type": "dynamic", "type": "dynamic"},
    "sliding_window": None,
    "use_sliding_window": False,
    "vocab_size": 151674,
    "torch_dtype": "bfloat16",
}
_INTERNVL3_COMMON: dict[str, Any] = {
    "architectures": ["InternVLForConditionalGeneration"],
    "model_type": "internvl",
    "downsample_ratio": 0.5,
    "image_seq_length": 256,
    "projector_hidden_act": "gelu",
    "vision_feature_layer": -1,
    "vision_feature_select_strategy": "default",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vision_config": _INTERNVIT_300M,
}
# llava-hf/llava-onevision-qwen2-{0.5b,7b}-ov-hf config.json: SigLIP-so400m cut to 26 layers (the
# last one's output, "full": 27 x 27 features per 384-pixel tile), anyres up to 6 x 6 tiles
# kept to about 9 tiles of features, the Qwen2-{0.5B,7B}-Instruct LM with two image/video
# tokens added and the vocabulary padded to a multiple of 64.
_LLAVA_ONEVISION_COMMON: dict[str, Any] = {
    "architectures": ["LlavaOnevisionForConditionalGeneration"],
    "model_type": "llava_onevision",
    "projector_hidden_act": "gelu",
    "vision_feature_layer": -1,
    "vision_feature_select_strategy": "full",
    "vision_aspect_ratio": "anyres_max_9",
    "image_grid_pinpoints": [[384 * r, 384 * c] for r in range(1, 7) for c in range(1, 7)],
    "vision_config": {
        "model_type": "siglip_vision_model",
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "image_size": 384,
        "patch_size": 14,
        "num_attention_heads": 16,
        "num_hidden_layers": 26,
        "vision_use_head": False,
    },
}
_QWEN2_INSTRUCT_TEXT: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
}

# Qwen3-VL-2B-Instruct / -8B-Instruct config.json (Hugging Face Hub), minus the token ids: a
# Qwen3 LM (q/k norms, interleaved M-RoPE 24:20:20, theta 5e6) and a tower of 16-pixel patches
# with a 48 x 48 learned position grid and three DeepStack mergers.
_QWEN3_VL_TEXT: dict[str, Any] = {
    "model_type": "qwen3_vl_text",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 262144,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "mrope_interleaved": True,
        "mrope_section": [24, 20, 20],
        "rope_type": "default",
    },
    "rope_theta": 5000000,
    "use_cache": True,
    "vocab_size": 151936,
    "dtype": "bfloat16",
}
_QWEN3_VL_VISION: dict[str, Any] = {
    "hidden_act": "gelu_pytorch_tanh",
    "in_channels": 3,
    "initializer_range": 0.02,
    "num_heads": 16,
    "num_position_embeddings": 2304,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
# Qwen3-VL's preprocessor_config.json settings: 16-pixel patches, 2x2 merge (32x32 pixels per
# image token), the resized area in [size.shortest_edge, size.longest_edge], mean and std 0.5.
QWEN3_VL_PREPROCESSOR: dict[str, Any] = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}

# google/gemma-3-4b-it config.json, its text_config's unset values at Gemma3TextConfig's
# defaults (8 heads, 4 KV heads of 256, query_pre_attn_scalar 256, window 1024 on five
# layers in six, RoPE 1e6 linear x8 on the full ones, 10,000 on the others).
_GEMMA3_4B: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "mm_tokens_per_image": 256,
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-06,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": 1024,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "torch_dtype": "bfloat16",
    },
    "vision_config": {
        "model_type": "siglip_vision_model",
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "layer_norm_eps": 1e-06,
        "vision_use_head": False,
    },
}
# HuggingFaceTB/SmolVLM-256M-Instruct and SmolVLM-Instruct (2.2B) config.json, minus the token
# ids: a SmolLM2 LM (135M, 1.7B) and a SigLIP tower (93M on 512-pixel tiles of 16-pixel
# patches; so400m on 384-pixel tiles of 14), pixel-shuffled by 4 and 3.
_SMOLVLM: dict[str, dict[str, Any]] = {
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


FAMILY_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "internvl3-8b": {
        **_INTERNVL3_COMMON,
        "text_config": {
            **_INTERNVL3_TEXT,
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
        },
    },
    "internvl3-2b": {
        **_INTERNVL3_COMMON,
        "text_config": {
            **_INTERNVL3_TEXT,
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
        },
    },
    "llava-onevision-qwen2-0.5b-ov": {
        **_LLAVA_ONEVISION_COMMON,
        "tie_word_embeddings": True,
        "text_config": {
            **_QWEN2_INSTRUCT_TEXT,
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "vocab_size": 152000,
            "tie_word_embeddings": True,
        },
    },
    "llava-onevision-qwen2-7b-ov": {
        **_LLAVA_ONEVISION_COMMON,
        "tie_word_embeddings": False,
        "text_config": {
            **_QWEN2_INSTRUCT_TEXT,
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152128,
            "tie_word_embeddings": False,
        },
    },
    "qwen3-vl-2b": {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "tie_word_embeddings": True,
        "text_config": {
            **_QWEN3_VL_TEXT,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_attention_heads": 16,
            "num_hidden_layers": 28,
            "tie_word_embeddings": True,
        },
        "vision_config": {
            **_QWEN3_VL_VISION,
            "depth": 24,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "out_hidden_size": 2048,
            "deepstack_visual_indexes": [5, 11, 17],
        },
    },
    "qwen3-vl-8b": {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "tie_word_embeddings": False,
        "text_config": {
            **_QWEN3_VL_TEXT,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_attention_heads": 32,
            "num_hidden_layers": 36,
            "tie_word_embeddings": False,
        },
        "vision_config": {
            **_QWEN3_VL_VISION,
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "out_hidden_size": 4096,
            "deepstack_visual_indexes": [8, 16, 24],
        },
    },
    # Qwen/Qwen3-VL-30B-A3B-Instruct: 48 layers of 128 experts (8 per token, width 768, every
    # layer sparse), the -8B's tower with a 2048-wide output.
    "qwen3-vl-30b-a3b": {
        "architectures": ["Qwen3VLMoeForConditionalGeneration"],
        "model_type": "qwen3_vl_moe",
        "tie_word_embeddings": False,
        "text_config": {
            **_QWEN3_VL_TEXT,
            "model_type": "qwen3_vl_moe_text",
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "num_hidden_layers": 48,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
        },
        "vision_config": {
            **_QWEN3_VL_VISION,
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "out_hidden_size": 2048,
            "deepstack_visual_indexes": [8, 16, 24],
        },
    },
    "gemma-3-4b": _GEMMA3_4B,
    **_SMOLVLM,
}


def save_generation_config(folder: str | os.PathLike, pad: int, eos: int) -> None:
    """``generation_config.json`` with token ids only (the benchmarks pass their own sampling
    parameters): BOS and pad ``pad``, EOS ``eos`` and ``pad``."""
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=pad, pad_token_id=pad, eos_token_id=[eos, pad]).save_pretrained(
        folder
    )


def write_internvl_architecture(values: dict[str, Any], folder: str | os.PathLike) -> str:
    """Write the weightless InternVL3 folder of config.json ``values`` (an entry of
    ``FAMILY_ARCHITECTURES``) into ``folder``; returns its path. The tokenizer: the small
    byte-level BPE with Qwen2's special tokens and InternVL's image tokens; the processor:
    ``InternVLProcessor`` with the published image settings (448 x 448 tiles, 1 to 12 of them
    and the thumbnail, ImageNet statistics, 256 image tokens per tile)."""
    from transformers import AutoConfig

    from mm_serve.checkpoint.dummy_processors import internvl_processor, internvl_tokenizer

    tokenizer = internvl_tokenizer()
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    values = dict(values)
    ids = {"bos_token_id": pad, "eos_token_id": eos, "pad_token_id": pad}
    text = {**values.pop("text_config"), **ids}
    config = AutoConfig.for_model(
        values.pop("model_type"),
        **values,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"),
    )
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    internvl_processor(tokenizer, 448, config.image_seq_length).save_pretrained(folder)
    save_generation_config(folder, pad, eos)
    return str(folder)


def write_llava_onevision_architecture(values: dict[str, Any], folder: str | os.PathLike) -> str:
    """Write the weightless LLaVA-OneVision folder of config.json ``values`` (an entry of
    ``FAMILY_ARCHITECTURES``) into ``folder``; returns its path. The processor: the published
    image processor settings (384-pixel tiles, the config's pinpoints; 729 tokens per tile),
    the small tokenizer with ``<image>`` and ``<video>``."""
    from transformers import AutoConfig

    from mm_serve.checkpoint.dummy_processors import onevision_processor, onevision_tokenizer

    tokenizer = onevision_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    pad, eos = ids("<|endoftext|>"), ids("<|im_end|>")
    values = dict(values)
    text = {**values.pop("text_config"), "bos_token_id": pad, "eos_token_id": eos}
    config = AutoConfig.for_model(
        values.pop("model_type"),
        **values,
        text_config=text,
        image_token_index=ids("<image>"),
        video_token_index=ids("<video>"),
    )
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    vision = config.vision_config
    processor = onevision_processor(
        tokenizer,
        tile=vision.image_size,
        pinpoints=config.image_grid_pinpoints,
        num_image_tokens=(vision.image_size // vision.patch_size) ** 2,
        vision_aspect_ratio=config.vision_aspect_ratio,
    )
    processor.save_pretrained(folder)
    save_generation_config(folder, pad, eos)
    return str(folder)


def write_gemma3_architecture(values: dict[str, Any], folder: str | os.PathLike) -> str:
    """Write the weightless Gemma 3 folder of config.json ``values`` into ``folder``; returns
    its path. The tokenizer has Gemma's special and image tokens; the processor is
    google/gemma-3-4b-it's (``Gemma3ImageProcessor`` at the tower's size, 896 x 896, bilinear,
    mean and std 0.5, no pan-and-scan; ``mm_tokens_per_image`` tokens per image)."""
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


def write_idefics3_architecture(values: dict[str, Any], folder: str | os.PathLike) -> str:
    """Write the weightless Idefics3/SmolVLM folder of config.json ``values`` into ``folder``;
    returns its path. The tokenizer has Idefics3's image, tile-tag and end-of-utterance tokens;
    ``Idefics3Processor`` tiles at the tower's ``image_size``, at most four tiles per side,
    ``(image_size / patch_size)**2 / scale_factor**2`` tokens per tile."""
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


# Families whose folders have their own tokenizer and processor, by config.json's model_type.
FAMILY_WRITERS = {
    "internvl": write_internvl_architecture,
    "llava_onevision": write_llava_onevision_architecture,
    "idefics3": write_idefics3_architecture,
    "gemma3": write_gemma3_architecture,
}
