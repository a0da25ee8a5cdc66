"""Which class serves a checkpoint: HF ``architectures`` name -> model class.

Entries are ``(module under mm_serve.models, class name)``, imported on first use so that
listing the supported architectures loads no model code. Every class takes the HF config in
``__init__`` and has ``load_weights``, ``forward``, ``compute_logits``, ``attention_layers``,
``bind_kv_cache`` and ``uses_mrope``; a VLM (``image_token_id``, ``embed_images``) gets the
full config, whose ``text_config`` its language model is built from.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    """The class for the first supported name in ``hf_config.architectures``.

    Raises ``ValueError`` naming the supported architectures when none is.
    """
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for arch in architectures:
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            module = importlib.import_module(f"mm_serve.models.{module_name}")
            return getattr(module, class_name)
    raise ValueError(
        f"Unsupported model architecture(s) {architectures or '(none in config.json)'}; "
        f"supported: {', '.join(supported_architectures())}."
    )
