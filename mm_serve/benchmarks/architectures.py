"""Checkpoint folders of real architectures without weights, for ``load_format="dummy"``.

``write_architecture(name, folder)`` writes what the engine and HF transformers need to build a
model and preprocess its inputs, every file through transformers' own ``save_pretrained``: the
model's config (built from its published ``config.json`` values: sizes, vocab, RoPE), its image
processor (the published ``preprocessor_config.json`` values), a ``GenerationConfig`` (token
ids only: the benchmarks pass their own sampling parameters) and a tokenizer. No
``*.safetensors``: load it with ``load_format="dummy"`` (random weights), or build the HF model
from its config.

The tokenizer is the small byte-level BPE of ``mm_serve.testing`` with Qwen2-VL's special
tokens and chat template (InternVL3's and LLaVA-OneVision's: with their image tokens, their
checkpoint modules): a real vocabulary cannot be shipped offline. So the special token
ids of the config are the small tokenizer's (they must agree with what it encodes), while
``vocab_size`` stays the published one: the embedding and LM head have their real sizes, and a
random model samples ids the tokenizer does not know (they decode to nothing).
"""

from __future__ import annotations

import os
from typing import Any

from mm_serve.benchmarks.idefics3_architecture import ARCHITECTURES as IDEFICS3_ARCHITECTURES

# Qwen2-VL-2B-Instruct / -7B-Instruct config.json (Hugging Face Hub), minus the token ids.
_QWEN2_VL_COMMON: dict[str, Any] = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "model_type": "qwen2_vl",
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "num_hidden_layers": 28,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "sliding_window": 32768,
    "use_sliding_window": False,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}
_QWEN2_VL_VISION: dict[str, Any] = {
    "depth": 32,
    "embed_dim": 1280,
    "mlp_ratio": 4,
    "num_heads": 16,
    "in_chans": 3,
    "patch_size": 14,
    "spatial_patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}

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

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen2-vl-2b": {
        **_QWEN2_VL_COMMON,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "vision_config": {**_QWEN2_VL_VISION, "hidden_size": 1536},
    },
    "qwen2-vl-7b": {
        **_QWEN2_VL_COMMON,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "vision_config": {**_QWEN2_VL_VISION, "hidden_size": 3584},
    },
    # Qwen2.5-VL-7B-Instruct config.json: the 7B LM, and a tower of SwiGLU blocks attending in
    # 112-pixel windows except the four full-attention blocks.
    "qwen2.5-vl-7b": {
        **_QWEN2_VL_COMMON,
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "max_position_embeddings": 128000,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "vision_config": {
            "depth": 32,
            "hidden_act": "silu",
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "in_chans": 3,
            "out_hidden_size": 3584,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "tokens_per_second": 2,
            "temporal_patch_size": 2,
        },
    },
    # The 2B's shape at toy size for CPU tests: 2 layers, GQA, M-RoPE 2:3:3, tied, the real
    # vocab (ids beyond the tokenizer get sampled), float32, the real image processor.
    "tiny-qwen2-vl": {
        **_QWEN2_VL_COMMON,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "max_window_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "vision_config": {
            **_QWEN2_VL_VISION,
            "depth": 2,
            "embed_dim": 32,
            "mlp_ratio": 2,
            "num_heads": 2,
            "hidden_size": 64,
        },
    },
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
ARCHITECTURES["qwen3-vl-2b"] = {
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
}
ARCHITECTURES["qwen3-vl-8b"] = {
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
}
# google/gemma-3-4b-it config.json, its text_config's unset values at Gemma3TextConfig's
# defaults (8 heads, 4 KV heads of 256, query_pre_attn_scalar 256, window 1024 on five
# layers in six, RoPE 1e6 linear x8 on the full ones, 10,000 on the others). Written by
# ``gemma3_architecture`` (Gemma's image tokens, its processor).
ARCHITECTURES["gemma-3-4b"] = {
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

ARCHITECTURES.update(IDEFICS3_ARCHITECTURES)

# Qwen2-VL's and Qwen2.5-VL's preprocessor_config.json settings: 14-pixel patches, 2x2 merge
# (28x28 pixels per image token), images resized into [min_pixels, max_pixels], CLIP
# normalisation. (Its "processor_class" is not a setting: transformers 5 no longer writes it,
# and AutoProcessor finds the processor from config.json's model_type.)
QWEN2_VL_PREPROCESSOR: dict[str, Any] = {
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
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


def architecture_names() -> list[str]:
    return sorted(ARCHITECTURES)


def _token_ids(tokenizer: Any) -> dict[str, Any]:
    """The special token ids of ``config.json``, as the tokenizer encodes them."""
    ids = tokenizer.convert_tokens_to_ids
    return {
        "bos_token_id": ids("<|endoftext|>"),
        "eos_token_id": ids("<|im_end|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
    }


def _build_config(name: str, token_ids: dict[str, int]) -> Any:
    """The transformers config of architecture ``name`` (its class by ``model_type``, e.g.
    ``Qwen2VLConfig``) from the published values, with ``token_ids`` (config.json's special
    token ids) set. Raises ``ValueError`` for an unknown name."""
    from transformers import AutoConfig

    if name not in ARCHITECTURES:
        raise ValueError(f"Unknown architecture {name!r}; choose from {architecture_names()}.")
    values = {**ARCHITECTURES[name], **token_ids}
    text_ids = {k: values.pop(k) for k in ("bos_token_id", "eos_token_id") if k in values}
    if text_ids and "text_config" in values:  # nested (Qwen3-VL): they go in text_config
        values["text_config"] = {**values["text_config"], **text_ids}
    else:
        values.update(text_ids)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def _build_image_processor(name: str) -> Any:
    """transformers' ``Qwen2VLImageProcessor`` with the published settings of architecture
    ``name`` (Qwen2-VL's and Qwen2.5-VL's, or Qwen3-VL's, which loads the same class)."""
    from mm_serve._compat import ensure_torchvision_importable

    ensure_torchvision_importable()
    from transformers import Qwen2VLImageProcessor

    qwen3 = ARCHITECTURES[name]["model_type"] == "qwen3_vl"
    return Qwen2VLImageProcessor(**(QWEN3_VL_PREPROCESSOR if qwen3 else QWEN2_VL_PREPROCESSOR))


def write_architecture(name: str, folder: str | os.PathLike) -> str:
    """Write the weightless checkpoint folder of architecture ``name`` (one of
    ``architecture_names()``) into ``folder`` (created if needed); returns its path.

    Files: ``config.json``, ``preprocessor_config.json``, ``generation_config.json`` and the
    tokenizer's, each written by the transformers object's ``save_pretrained``.

    Raises ``ValueError`` for an unknown name.
    """
    from transformers import GenerationConfig

    from mm_serve.testing.vlm_checkpoints import vlm_tokenizer

    if ARCHITECTURES.get(name, {}).get("model_type") == "internvl":
        return _write_internvl(name, folder)
    if ARCHITECTURES.get(name, {}).get("model_type") == "llava_onevision":
        return _write_llava_onevision(name, folder)
    if ARCHITECTURES.get(name, {}).get("model_type") == "idefics3":
        from mm_serve.benchmarks.idefics3_architecture import write_idefics3_architecture

        return write_idefics3_architecture(ARCHITECTURES[name], folder)
    if ARCHITECTURES.get(name, {}).get("model_type") == "gemma3":
        from mm_serve.benchmarks.gemma3_architecture import write_gemma3_architecture

        return write_gemma3_architecture(ARCHITECTURES[name], folder)

    # The tests' byte-level BPE with Qwen2's and Qwen2-VL's special tokens and chat template.
    tokenizer = vlm_tokenizer("qwen2_vl")
    ids = _token_ids(tokenizer)
    config = _build_config(name, ids)
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    _build_image_processor(name).save_pretrained(folder)
    pad = ids["bos_token_id"]
    eos = [ids["eos_token_id"], pad]
    GenerationConfig(bos_token_id=pad, pad_token_id=pad, eos_token_id=eos).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _write_internvl(name: str, folder: str | os.PathLike) -> str:
    """``write_architecture`` for an InternVL3 architecture: the tests' byte-level BPE with
    Qwen2's special tokens and InternVL's image tokens, and ``InternVLProcessor`` with the
    published image settings (448 x 448 tiles, 1 to 12 of them and the thumbnail, ImageNet
    statistics, 256 image tokens per tile)."""
    from transformers import GenerationConfig

    from mm_serve.testing.internvl_checkpoint import internvl_processor, internvl_tokenizer

    tokenizer = internvl_tokenizer()
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    ids = {"bos_token_id": pad, "eos_token_id": eos, "pad_token_id": pad}
    text = {**ARCHITECTURES[name]["text_config"], **ids}
    image_token_id = tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
    config = _build_config(name, {"text_config": text, "image_token_id": image_token_id})
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    internvl_processor(tokenizer, 448, config.image_seq_length).save_pretrained(folder)
    GenerationConfig(bos_token_id=pad, pad_token_id=pad, eos_token_id=[eos, pad]).save_pretrained(
        folder
    )
    return str(folder)


def _write_llava_onevision(name: str, folder: str | os.PathLike) -> str:
    """``write_architecture`` for a LLaVA-OneVision architecture: ``config.json``,
    ``generation_config.json`` and the ``LlavaOnevisionProcessor``'s files (the published
    image processor settings: 384-pixel tiles, the config's pinpoints; 729 tokens per tile;
    the small tokenizer with ``<image>`` and ``<video>``)."""
    from transformers import AutoConfig, GenerationConfig

    from mm_serve.testing.llava_onevision_checkpoint import (
        onevision_processor,
        onevision_tokenizer,
    )

    tokenizer = onevision_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    pad, eos = ids("<|endoftext|>"), ids("<|im_end|>")
    values = dict(ARCHITECTURES[name])
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
    GenerationConfig(bos_token_id=pad, pad_token_id=pad, eos_token_id=[eos, pad]).save_pretrained(
        folder
    )
    return str(folder)
