"""The one registry of model families: a checkpoint's ``architectures`` (else its
``model_type``) -> its model class and image processor, named as ``"module:attribute"`` and
imported on first use (the API server reads it, and imports nothing of ``mm_serve.models``)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelFamily:
    """``model_class``: a ``models.interface.LanguageModel``; ``image_processor``: None for a
    text-only model, else ``(settings, hf_config, max_pixels, model_path) -> ImageProcessor``;
    ``video_processor``: None for a model without videos, else ``(settings, hf_config,
    model_path) -> VideoProcessor`` (``encoders/video_processors.py``).

    ``placeholder_token``: the config attribute naming the prompt's image placeholder token
    (None: the image token itself, ``image_token_id``). ``bidirectional_images``: the tokens
    of one image attend to each other in prefill, so a prefill chunk never cuts an image
    (``SchedulerConfig.whole_images``). ``sliding_window``: the text config's ``layer_types``
    and ``sliding_window`` are honoured, sliding-window layers in KV-cache groups of their own
    (``cache.kv_cache_groups``)."""

    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    model_class: str
    image_processor: str | None = None
    video_processor: str | None = None
    placeholder_token: str | None = None
    bidirectional_images: bool = False
    sliding_window: bool = False


_QWEN2_VL_PROCESSOR = "mm_serve.encoders.processors:qwen2_vl_image_processor"
_QWEN2_VL_VIDEO_PROCESSOR = "mm_serve.encoders.qwen2_vl_video_processor:qwen2_vl_video_processor"
FAMILIES = (
    ModelFamily(("LlamaForCausalLM",), ("llama",), "mm_serve.models.llama:LlamaForCausalLM"),
    ModelFamily(("Qwen2ForCausalLM",), ("qwen2",), "mm_serve.models.llama:LlamaForCausalLM"),
    ModelFamily(("MistralForCausalLM",), ("mistral",), "mm_serve.models.llama:LlamaForCausalLM"),
    ModelFamily(
        ("Qwen2VLForConditionalGeneration",),
        ("qwen2_vl",),
        "mm_serve.models.qwen2_vl:Qwen2VLForConditionalGeneration",
        _QWEN2_VL_PROCESSOR,
        _QWEN2_VL_VIDEO_PROCESSOR,
    ),
    ModelFamily(
        ("Qwen2_5_VLForConditionalGeneration",),
        ("qwen2_5_vl",),
        "mm_serve.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration",
        _QWEN2_VL_PROCESSOR,
        _QWEN2_VL_VIDEO_PROCESSOR,
    ),
    ModelFamily(
        ("LlavaForConditionalGeneration",),
        ("llava",),
        "mm_serve.models.llava:LlavaForConditionalGeneration",
        "mm_serve.encoders.processors:clip_image_processor",
    ),
    ModelFamily(
        ("Idefics3ForConditionalGeneration",),
        ("idefics3",),
        "mm_serve.models.idefics3:Idefics3ForConditionalGeneration",
        "mm_serve.encoders.processors:idefics3_image_processor",
    ),
    ModelFamily(
        ("InternVLForConditionalGeneration",),
        ("internvl",),
        "mm_serve.models.internvl:InternVLForConditionalGeneration",
        "mm_serve.encoders.processors:internvl_image_processor",
    ),
    ModelFamily(
        ("LlavaOnevisionForConditionalGeneration",),
        ("llava_onevision",),
        "mm_serve.models.llava_onevision:LlavaOnevisionForConditionalGeneration",
        "mm_serve.encoders.processors:llava_onevision_image_processor",
    ),
    ModelFamily(
        ("Qwen3VLForConditionalGeneration",),
        ("qwen3_vl",),
        "mm_serve.models.qwen3_vl:Qwen3VLForConditionalGeneration",
        _QWEN2_VL_PROCESSOR,  # Qwen3-VL checkpoints use Qwen2VLImageProcessor (patch 16)
        "mm_serve.encoders.qwen3_vl_video_processor:qwen3_vl_video_processor",
    ),
    ModelFamily(
        ("Qwen3VLMoeForConditionalGeneration",),
        ("qwen3_vl_moe",),
        "mm_serve.models.qwen3_vl_moe:Qwen3VLMoeForConditionalGeneration",
        _QWEN2_VL_PROCESSOR,
        "mm_serve.encoders.qwen3_vl_video_processor:qwen3_vl_video_processor",
    ),
    ModelFamily(
        ("Gemma3ForConditionalGeneration",),
        ("gemma3",),
        "mm_serve.models.gemma3:Gemma3ForConditionalGeneration",
        "mm_serve.encoders.processors:gemma3_image_processor",
        placeholder_token="boi_token_id",
        bidirectional_images=True,
        sliding_window=True,
    ),
)
VLM_MODEL_TYPES = tuple(t for f in FAMILIES if f.image_processor for t in f.model_types)


def config_get(config: Any, key: str, default: Any = None) -> Any:
    """Field of an HF config object or of its dict form."""
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def find_family(hf_config: Any) -> ModelFamily | None:
    """The family of the first known name in ``architectures``, else of ``model_type``."""
    for arch in config_get(hf_config, "architectures") or ():
        for family in FAMILIES:
            if arch in family.architectures:
                return family
    model_type = config_get(hf_config, "model_type")
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def get_family(hf_config: Any) -> ModelFamily:
    """``find_family``, or ``ValueError`` naming the supported architectures."""
    family = find_family(hf_config)
    if family is None:
        found = list(config_get(hf_config, "architectures") or [])
        supported = sorted(a for f in FAMILIES for a in f.architectures)
        raise ValueError(
            f"Unsupported model architecture(s) {found or '(none in config.json)'}; "
            f"supported: {', '.join(supported)}."
        )
    return family


def resolve(reference: str) -> Any:
    """The attribute a ``"module:attribute"`` string names (imports the module)."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)
