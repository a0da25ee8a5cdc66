"""Tiny, deterministic vision-language checkpoints (Qwen2-VL, Qwen2.5-VL, LLaVA) for tests.

``build_tiny_vlm_checkpoint`` writes a folder shaped like the real checkpoint: the text
builder's byte-level BPE tokenizer plus the family's image tokens, a chat template that
renders image parts as the family's placeholder, ``config.json`` (tiny text and vision
configs), the HF processor files (small image sizes, so few image tokens) and float32
safetensors, every file written by transformers' own ``save_pretrained``.
``AutoProcessor.from_pretrained`` and the HF model load from it.

Two layouts (``LAYOUTS``), as ``AutoProcessor`` reads both: "transformers" is what the installed
transformers writes (5.x: the image processor settings nested in ``processor_config.json``,
``chat_template.jinja``, no ``preprocessor_config.json``); "legacy" is the hub's older layout
(``preprocessor_config.json``, the chat template in ``chat_template.json``), made by
``to_legacy_layout``.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

from mm_serve._compat import ensure_torchvision_importable
from mm_serve.testing.family_checkpoint import (
    checked_vocab_size,
    family_tokenizer,
    random_model,
    save_checkpoint,
    shrink_projector,
    text_token_ids,
)

QWEN_VL_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
LLAVA_IMAGE_TOKEN = "<image>"

# As Qwen2-VL-Instruct's template: image parts become <|vision_start|><|image_pad|><|vision_end|>
# (the processor repeats <|image_pad|> once per image token), video parts the same with
# <|video_pad|>.
QWEN_VL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ('video', 'video_url') -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Vicuna style, as llava-1.5-hf: "USER: <image>\nWhat is this? ASSISTANT:" (the tokenizer adds
# the BOS token).
LLAVA_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- message['content'] + ' ' -}}"
    "{%- else -%}{{- message['role'].upper() + ': ' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{- '<image>\\n' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- ' ' if message['role'] == 'user' else '</s>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'ASSISTANT:' -}}{%- endif -%}"
)

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava")
# Families whose images expand to more than image tokens (tile tags, newlines) or to tiles of
# any resolution: built by their own module, and not in ``FAMILIES`` (tests/test_vlm_models.py
# runs those).
TILED_FAMILIES = ("idefics3", "internvl", "llava_onevision", "gemma3")
# Built by its own module (``qwen3_vl_checkpoint``) with this module's tokenizer and text sizes.
QWEN3_VL = "qwen3_vl"
_TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    initializer_range=0.3,  # peaked logits: no greedy near-ties between implementations
)
# Qwen2-VL: 8 rotary frequencies (head_dim 16) split 2:3:3 like the real 16:24:24.
_MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 64
LLAVA_IMAGE_SIZE = 56  # 4 x 4 patches of 14 -> 16 image tokens


def vlm_tokenizer(family: str) -> Any:
    """The text builder's tokenizer plus the family's image tokens and chat template."""
    if family == "llava":
        return family_tokenizer("llama", [LLAVA_IMAGE_TOKEN], LLAVA_CHAT_TEMPLATE)
    return family_tokenizer("qwen2", QWEN_VL_SPECIALS, QWEN_VL_CHAT_TEMPLATE)


def _token_ids(tokenizer: Any, vocab_size: int | None = None) -> dict[str, Any]:
    """config.json's special token ids and ``vocab_size`` (default: the tokenizer's length):
    the text config's (``text_token_ids``) under "text", the image ones beside."""
    ids = tokenizer.convert_tokens_to_ids
    common = text_token_ids(tokenizer, vocab_size)
    if LLAVA_IMAGE_TOKEN in tokenizer.get_vocab():
        return {"text": common, "image_token_id": ids(LLAVA_IMAGE_TOKEN)}
    return {
        "text": common,
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
    }


def _build_config(family: str, tokenizer: Any, vocab_size: int) -> Any:
    ids = _token_ids(tokenizer, vocab_size)
    text = {**_TEXT, **ids.pop("text")}
    if family == "llava":
        return _llava_config(text, ids)
    return _qwen_vl_config(family, {**text, "rope_parameters": dict(_MROPE)}, ids)


def _llava_config(text: dict[str, Any], ids: dict[str, Any]) -> Any:
    from transformers import LlavaConfig

    vision = dict(
        model_type="clip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,  # the last one unused: LLaVA takes the penultimate layer
        num_attention_heads=2,
        image_size=LLAVA_IMAGE_SIZE,
        patch_size=14,
        projection_dim=32,
    )
    return LlavaConfig(
        text_config={**text, "model_type": "llama", "rope_theta": 500000.0},
        vision_config=vision,
        image_seq_length=(LLAVA_IMAGE_SIZE // 14) ** 2,
        architectures=["LlavaForConditionalGeneration"],
        **ids,
    )


def _qwen_vl_config(family: str, text: dict[str, Any], ids: dict[str, Any]) -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    # Init between HF's 0.02 and the text 0.3: image embeddings about as large as token ones.
    common = dict(depth=2, num_heads=2, patch_size=14, spatial_merge_size=2, initializer_range=0.05)
    if family == "qwen2_vl":
        vision = dict(embed_dim=32, hidden_size=_TEXT["hidden_size"], mlp_ratio=2, **common)
        config_cls, arch = Qwen2VLConfig, "Qwen2VLForConditionalGeneration"
    else:
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            out_hidden_size=_TEXT["hidden_size"],
            window_size=56,  # 2 x 2 merged units per window: images of a few windows
            fullatt_block_indexes=[1],
            **common,
        )
        config_cls, arch = Qwen2_5_VLConfig, "Qwen2_5_VLForConditionalGeneration"
    return config_cls(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=True,  # as Qwen2-VL-2B
        architectures=[arch],
        **ids,
    )


def _build_processor(family: str, tokenizer: Any) -> Any:
    ensure_torchvision_importable()
    if family == "llava":
        from transformers import CLIPImageProcessor, LlavaProcessor

        size = LLAVA_IMAGE_SIZE
        image_processor = CLIPImageProcessor(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}
        )
        return LlavaProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=14,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,  # the CLS token, dropped by the "default" strategy
            chat_template=LLAVA_CHAT_TEMPLATE,
        )
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    pixels = dict(min_pixels=QWEN_MIN_PIXELS, max_pixels=QWEN_MAX_PIXELS)
    processor_cls = _processor_class(family)
    return processor_cls(
        image_processor=Qwen2VLImageProcessor(**pixels),
        # cap_pixels_per_frame given (transformers' present default, False): unset, each
        # call warns that the default will change.
        video_processor=Qwen2VLVideoProcessor(**pixels, cap_pixels_per_frame=False),
        tokenizer=tokenizer,
        chat_template=QWEN_VL_CHAT_TEMPLATE,
    )


def _processor_class(family: str) -> type:
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor

    return Qwen2VLProcessor if family == "qwen2_vl" else Qwen2_5_VLProcessor


def tokenizer_size(family: str) -> int:
    """``len(tokenizer)`` of ``family``'s checkpoint tokenizer (its ids are ``0..size-1``)."""
    return len(vlm_tokenizer(family))


def _model_class(family: str) -> type:
    import transformers

    name = {
        "qwen2_vl": "Qwen2VLForConditionalGeneration",
        "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
        "llava": "LlavaForConditionalGeneration",
    }[family]
    return getattr(transformers, name)


LAYOUTS = ("transformers", "legacy")


def build_tiny_vlm_checkpoint(
    path: str | os.PathLike,
    family: str,
    seed: int = 0,
    *,
    vocab_size: int | None = None,
    layout: str = "transformers",
) -> str:
    """Write a tiny ``family`` ("qwen2_vl", "qwen2_5_vl", "llava", "idefics3", "internvl",
    "llava_onevision", "qwen3_vl" or "gemma3") checkpoint.

    Text: hidden 64, 2 layers, 4 heads, 2 KV heads, intermediate 128 (Qwen: mrope sections
    2:3:3, tied embeddings). Vision: 2-3 layers of width 32, patch 14, merge 2; Qwen images
    are resized into ``[QWEN_MIN_PIXELS, QWEN_MAX_PIXELS]`` (4 to 64 image tokens), LLaVA's to
    56 x 56 (16 image tokens); Idefics3's (a Llama LM): see ``idefics3_checkpoint``; InternVL's
    and LLaVA-OneVision's (Qwen2 LMs): see ``internvl_checkpoint``, ``llava_onevision_checkpoint``;
    Qwen3-VL's (Qwen2-VL's tokenizer, a Qwen3 LM with DeepStack): see ``qwen3_vl_checkpoint``;
    Gemma 3's: see ``gemma3_checkpoint``. Float32 weights; same arguments, same bytes.
    Returns ``path``.

    ``vocab_size`` (default: the tokenizer's length) sets the embedding and LM-head rows; more
    rows than the tokenizer has, as real checkpoints do (Qwen2-VL: 151936 rows, 151657 tokens),
    make a model that can emit ids the tokenizer lacks. ``tokenizer_size(family)`` gives
    the tokenizer's length. ``layout`` is one of ``LAYOUTS`` (see the module docstring).

    Raises:
        ValueError: an unknown family or layout, or ``vocab_size`` below the tokenizer's length.
    """
    known = FAMILIES + TILED_FAMILIES + (QWEN3_VL,)
    if family not in known:
        raise ValueError(f"Unknown family {family!r}; choose from {known}.")
    if layout not in LAYOUTS:
        raise ValueError(f"Unknown layout {layout!r}; choose from {LAYOUTS}.")
    if family in TILED_FAMILIES + (QWEN3_VL,) and layout != "transformers":
        raise ValueError(f"The {family} checkpoint has the transformers layout only.")
    if family in TILED_FAMILIES:  # each in its own module, with its own tokenizer
        module = importlib.import_module(f"mm_serve.testing.{family}_checkpoint")
        build = getattr(module, f"build_tiny_{family}_checkpoint")
        return build(path, dict(_TEXT), seed, vocab_size)
    tokenizer = vlm_tokenizer(family)
    vocab_size = checked_vocab_size(tokenizer, vocab_size)
    if family == QWEN3_VL:
        from mm_serve.testing.qwen3_vl_checkpoint import build_tiny_qwen3_vl_checkpoint

        ids = _token_ids(tokenizer, vocab_size)
        text = {**_TEXT, **ids.pop("text")}
        return build_tiny_qwen3_vl_checkpoint(path, tokenizer, text, ids, seed)
    model = random_model(_model_class(family), _build_config(family, tokenizer, vocab_size), seed)
    if family == "llava":
        projector = model.model.multi_modal_projector
        shrink_projector(projector.linear_1, projector.linear_2)
    processor = _build_processor(family, tokenizer)
    save_checkpoint(path, model, processor)
    if layout == "legacy":
        to_legacy_layout(path, processor)
    return str(path)


def to_legacy_layout(path: str | os.PathLike, processor: Any) -> None:
    """Turn the folder ``processor.save_pretrained`` wrote (transformers 5) into the hub's
    older layout, as Qwen2-VL-2B-Instruct and llava-1.5-7b-hf were published:

    - ``preprocessor_config.json``, written by the image processor's own ``save_pretrained``
      (Qwen's with top-level ``min_pixels``/``max_pixels`` instead of ``size``, as the Qwen
      hub files have), tagged with the ``processor_class``;
    - ``processor_config.json`` keeps only the processor's own kwargs, and is removed when it
      has none (Qwen; LLaVA keeps ``patch_size``, ``vision_feature_select_strategy``, ...);
    - the chat template moves from ``chat_template.jinja`` to ``chat_template.json``
      (transformers 4.4x's processor file), so only the processor, not the tokenizer, has it.

    Every value is transformers' own serialisation; only what transformers 5 can no longer
    write is edited here (each edit says why).
    """
    folder = Path(path)
    # transformers 5 always nests the sub-processors in processor_config.json; 4.4x saved them
    # in their own files, leaving the processor's own kwargs (its ``to_dict`` minus those).
    own = {k: v for k, v in processor.to_dict().items() if k not in processor.get_attributes()}
    (folder / "processor_config.json").unlink()
    if set(own) - {"processor_class"}:
        _write_json(folder / "processor_config.json", own)
    processor.image_processor.save_pretrained(folder)
    # transformers 5's image processor drops "processor_class" and keeps Qwen's pixel bounds
    # as ``size``; the hub files have both as top-level keys.
    image_config = _read_json(folder / "preprocessor_config.json")
    image_config["processor_class"] = own["processor_class"]
    size = image_config.get("size", {})
    if "longest_edge" in size:  # Qwen: an area range, not a size
        del image_config["size"]
        image_config["min_pixels"] = size["shortest_edge"]
        image_config["max_pixels"] = size["longest_edge"]
    _write_json(folder / "preprocessor_config.json", image_config)
    # transformers 5 reads chat_template.json but never writes it: the processor writes
    # chat_template.jinja, and the tokenizer's save_jinja_files=False, tokenizer_config.json.
    template = folder / "chat_template.jinja"
    _write_json(folder / "chat_template.json", {"chat_template": template.read_text()})
    template.unlink()


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _write_json(path: str | os.PathLike, value: dict) -> None:
    """As transformers' ``to_json_file`` writes its files."""
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
