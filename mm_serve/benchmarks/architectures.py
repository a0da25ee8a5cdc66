"""Checkpoint folders of real architectures without weights, for ``load_format="dummy"``.

``write_architecture(name, folder)`` (``mm-serve bench architecture NAME FOLDER``) writes, each
through transformers' ``save_pretrained``, the model's config (its published ``config.json``
values), its image processor (published settings), a ``GenerationConfig`` (token ids only) and
a tokenizer; no ``*.safetensors``. Here: Qwen2-VL's and Qwen2.5-VL's configs and the writer of
their folders (also Qwen3-VL's); the other families' are in ``family_architectures``.

The tokenizer is the small byte-level BPE of ``mm_serve.checkpoint.dummy_processors`` (a real
vocabulary cannot ship offline) with the family's special tokens and chat template. The config's
special token ids are the small tokenizer's; ``vocab_size`` stays the published one, so the
embedding and LM head have their real sizes and sampled ids the tokenizer lacks decode to nothing.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from mm_serve.benchmarks.family_architectures import (
    FAMILY_ARCHITECTURES,
    FAMILY_WRITERS,
    QWEN3_VL_PREPROCESSOR,
    save_generation_config,
)
from mm_serve.checkpoint.dummy_processors import qwen_vl_image_token_ids

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
}
# InternVL3, LLaVA-OneVision, Qwen3-VL, Gemma 3 and SmolVLM (configs beside their writers).
ARCHITECTURES.update(FAMILY_ARCHITECTURES)

# Quantized releases' quantization_config: fine-grained FP8 as Qwen publishes its -FP8
# checkpoints, and compressed-tensors W4A16 as RedHatAI's llm-compressor releases (the tower
# and lm_head left in bf16).
QUANTIZATION_CONFIGS: dict[str, dict[str, Any]] = {
    "fp8": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["visual", "lm_head"],
    },
    "w4a16": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head", "re:visual.*"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "format": "pack-quantized",
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 128,
                    "dynamic": False,
                    "observer": "minmax",
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
    },
}
for _name in ("qwen2-vl-2b", "qwen2.5-vl-7b"):
    for _method, _config in QUANTIZATION_CONFIGS.items():
        ARCHITECTURES[f"{_name}-{_method}"] = {
            **ARCHITECTURES[_name],
            "quantization_config": _config,
        }

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


def architecture_names() -> list[str]:
    return sorted(ARCHITECTURES)


def _token_ids(tokenizer: Any) -> dict[str, Any]:
    """The special token ids of ``config.json``, as the tokenizer encodes them."""
    ids = tokenizer.convert_tokens_to_ids
    return {
        "bos_token_id": ids("<|endoftext|>"),
        "eos_token_id": ids("<|im_end|>"),
        **qwen_vl_image_token_ids(tokenizer),
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
    ``name`` (Qwen2-VL's and Qwen2.5-VL's, or Qwen3-VL's and Qwen3-VL-MoE's, which load the
    same class)."""
    from mm_serve.utils._compat import ensure_torchvision_importable

    ensure_torchvision_importable()
    from transformers import Qwen2VLImageProcessor

    qwen3 = ARCHITECTURES[name]["model_type"] in ("qwen3_vl", "qwen3_vl_moe")
    return Qwen2VLImageProcessor(**(QWEN3_VL_PREPROCESSOR if qwen3 else QWEN2_VL_PREPROCESSOR))


def write_architecture(name: str, folder: str | os.PathLike) -> str:
    """Write the weightless checkpoint folder of architecture ``name`` (one of
    ``architecture_names()``) into ``folder`` (created if needed); returns its path.

    Files: ``config.json``, ``preprocessor_config.json``, ``generation_config.json`` and the
    tokenizer's, each written by the transformers object's ``save_pretrained``.

    Raises ``ValueError`` for an unknown name.
    """
    from mm_serve.checkpoint.dummy_processors import vlm_tokenizer

    family_writer = FAMILY_WRITERS.get(ARCHITECTURES.get(name, {}).get("model_type"))
    if family_writer is not None:
        return family_writer(ARCHITECTURES[name], folder)

    # The small byte-level BPE with Qwen2's and Qwen2-VL's special tokens and chat template.
    tokenizer = vlm_tokenizer("qwen2_vl")
    ids = _token_ids(tokenizer)
    config = _build_config(name, ids)
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    _build_image_processor(name).save_pretrained(folder)
    save_generation_config(folder, pad=ids["bos_token_id"], eos=ids["eos_token_id"])
    tokenizer.save_pretrained(folder)
    return str(folder)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``mm-serve bench architecture``."""
    parser.add_argument("name", choices=architecture_names(), help="The architecture.")
    parser.add_argument("folder", help="Where to write it (created if needed).")


def main(args: argparse.Namespace) -> str:
    """Write the folder; prints and returns its path."""
    folder = write_architecture(args.name, args.folder)
    print(folder)
    return folder
