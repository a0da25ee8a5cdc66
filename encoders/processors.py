"""Pick and build a checkpoint's image processor from its folder and HF config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mm_serve.encoders.base import ImageProcessor
from mm_serve.encoders.clip_processor import CLIPImageProcessor
from mm_serve.encoders.qwen2_vl_processor import Qwen2VLImageProcessor

PREPROCESSOR_CONFIG = "preprocessor_config.json"
QWEN2_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")
LLAVA_TYPES = ("llava",)
SUPPORTED_MODEL_TYPES = QWEN2_VL_TYPES + LLAVA_TYPES


def _get(config: Any, key: str, default: Any = None) -> Any:
    """Field of an HF config object or of its dict form."""
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def read_preprocessor_config(model_path: str | Path) -> dict[str, Any]:
    """The parsed ``preprocessor_config.json`` of a checkpoint folder.

    Raises:
        FileNotFoundError: the folder has no ``preprocessor_config.json``.
        ValueError: the file is not a JSON object.
    """
    path = Path(model_path) / PREPROCESSOR_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a VLM checkpoint needs its image processor.")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}.")
    return config


def llava_num_image_tokens(hf_config: Any) -> int:
    """Placeholder tokens per image of a LLaVA(-1.5) model: one per vision patch, plus the
    CLS token when ``vision_feature_select_strategy == "full"`` ("default" drops it).

    As HF's ``LlavaProcessor``: ``(image_size // patch_size) ** 2 + 1`` (patches + CLS), minus
    one for "default".
    """
    vision_config = _get(hf_config, "vision_config")
    if vision_config is None:
        raise ValueError("The LLaVA config has no vision_config.")
    grid = int(_get(vision_config, "image_size")) // int(_get(vision_config, "patch_size"))
    strategy = _get(hf_config, "vision_feature_select_strategy", "default")
    return grid * grid + (1 if strategy == "full" else 0)


def get_image_processor(
    model_path: str | Path, hf_config: Any, max_pixels: int | None = None
) -> ImageProcessor:
    """The image processor of the checkpoint at ``model_path`` (a local folder).

    Dispatches on ``hf_config.model_type``: ``qwen2_vl`` and ``qwen2_5_vl`` →
    ``Qwen2VLImageProcessor`` (``max_pixels`` overrides the config's bound on the resized
    area, and ``min_pixels`` is clamped not to exceed it); ``llava`` →
    ``CLIPImageProcessor`` (fixed resolution: ``max_pixels`` does not apply).

    Raises:
        ValueError: an unsupported model type, or a bad ``preprocessor_config.json``.
        FileNotFoundError: no ``preprocessor_config.json`` in the folder.
    """
    model_type = _get(hf_config, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"No image processor for model type {model_type!r}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    if max_pixels is not None and max_pixels <= 0:
        raise ValueError(f"max_pixels must be positive, got {max_pixels}.")
    config = read_preprocessor_config(model_path)
    if model_type in QWEN2_VL_TYPES:
        return Qwen2VLImageProcessor.from_config(config, max_pixels=max_pixels)
    return CLIPImageProcessor.from_config(config, num_tokens=llava_num_image_tokens(hf_config))
