"""A checkpoint's HF processor files: its image processor and its chat template.

Two layouts, resolved in transformers' order (``ImageProcessingMixin.get_image_processor_dict``,
``ProcessorMixin.get_processor_dict``):

- transformers 5: ``processor_config.json`` with the image (and video) processor settings under
  ``"image_processor"``; the chat template in ``chat_template.jinja``;
- the hub's older one: ``preprocessor_config.json`` with the image processor settings
  (``processor_config.json`` only the processor's kwargs); the chat template in
  ``chat_template.json`` and/or ``tokenizer_config.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mm_serve.checkpoint.families import VLM_MODEL_TYPES, config_get, find_family, resolve
from mm_serve.encoders.anyres import max_tiles
from mm_serve.encoders.base import ImageProcessor
from mm_serve.encoders.clip_processor import CLIPImageProcessor
from mm_serve.encoders.gemma3_processor import Gemma3ImageProcessor
from mm_serve.encoders.idefics3_processor import (
    Idefics3ImageProcessor,
    Idefics3Tokens,
    image_seq_len,
)
from mm_serve.encoders.internvl_processor import InternVLImageProcessor, InternVLTokens
from mm_serve.encoders.internvl_processor import image_seq_len as internvl_image_seq_len
from mm_serve.encoders.llava_onevision_processor import LlavaOnevisionImageProcessor
from mm_serve.encoders.qwen2_vl_processor import Qwen2VLImageProcessor

PROCESSOR_CONFIG = "processor_config.json"
PREPROCESSOR_CONFIG = "preprocessor_config.json"
CHAT_TEMPLATE_JSON = "chat_template.json"  # the older processor layout's template file
CHAT_TEMPLATE_JINJA = "chat_template.jinja"
# A video processor's own mm_processor_kwargs (frame sampling): where the family takes videos,
# its image processor never sees them. Keys both take (Qwen2-VL's min_pixels, max_pixels)
# apply to both, as transformers routes a processor call's kwargs.
VIDEO_SAMPLING_KWARGS = ("fps", "num_frames", "do_sample_frames", "min_frames", "max_frames")


def _read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when there is no such file.

    Raises:
        ValueError: the file is not valid JSON or not an object.
    """
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}.")
    return value


def read_image_processor_config(model_path: str | Path) -> dict[str, Any]:
    """The image processor settings of a checkpoint folder, as transformers finds them: the
    ``"image_processor"`` object nested in ``processor_config.json`` (transformers 5), else
    ``preprocessor_config.json`` (the hub's older layout).

    Raises:
        FileNotFoundError: neither file holds image processor settings.
        ValueError: one of the files is not a JSON object, or the nested settings are not.
    """
    folder = Path(model_path)
    processor_config = _read_json_object(folder / PROCESSOR_CONFIG) or {}
    nested = processor_config.get("image_processor")
    if nested is not None:
        if not isinstance(nested, dict):
            raise ValueError(f"{folder / PROCESSOR_CONFIG}: 'image_processor' must be an object.")
        return nested
    config = _read_json_object(folder / PREPROCESSOR_CONFIG)
    if config is None:
        raise FileNotFoundError(
            f"No image processor settings in {folder}: a VLM checkpoint needs "
            f"{PROCESSOR_CONFIG} with an 'image_processor' entry (transformers 5) or "
            f"{PREPROCESSOR_CONFIG} (older checkpoints)."
        )
    return config


def read_chat_template(model_path: str | Path) -> str | None:
    """The chat template of a checkpoint's processor, as ``AutoProcessor.from_pretrained``
    reads it: ``processor_config.json``'s ``"chat_template"``, else ``chat_template.json``'s,
    else ``chat_template.jinja``. Of a set of named templates, the ``"default"`` one.

    Returns None when the folder has none of them; the tokenizer's own template (from
    ``tokenizer_config.json``) then applies, as vLLM does.

    Raises:
        ValueError: a file is not valid JSON, or its template is neither text nor a set of
            named templates with a "default".
    """
    folder = Path(model_path)
    for file in (PROCESSOR_CONFIG, CHAT_TEMPLATE_JSON):
        template = (_read_json_object(folder / file) or {}).get("chat_template")
        if template is not None:
            return _default_template(template, folder / file)
    jinja = folder / CHAT_TEMPLATE_JINJA
    return jinja.read_text(encoding="utf-8") if jinja.is_file() else None


def _default_template(template: Any, source: Path) -> str:
    """A template as a processor file stores it: text, or ``{name: text}`` with a default."""
    if isinstance(template, dict):
        template = template.get("default")
    if not isinstance(template, str):
        raise ValueError(f"{source}: 'chat_template' must be text or have a 'default' template.")
    return template


def llava_num_image_tokens(hf_config: Any) -> int:
    """Placeholder tokens per image of a LLaVA(-1.5) model: one per vision patch, plus the
    CLS token when ``vision_feature_select_strategy == "full"`` ("default" drops it).

    As HF's ``LlavaProcessor``: ``(image_size // patch_size) ** 2 + 1`` (patches + CLS), minus
    one for "default".
    """
    vision_config = config_get(hf_config, "vision_config")
    if vision_config is None:
        raise ValueError("The LLaVA config has no vision_config.")
    grid = int(config_get(vision_config, "image_size")) // int(
        config_get(vision_config, "patch_size")
    )
    strategy = config_get(hf_config, "vision_feature_select_strategy", "default")
    return grid * grid + (1 if strategy == "full" else 0)


def qwen2_vl_image_processor(
    config: dict[str, Any], hf_config: Any, max_pixels: int | None, model_path: str | Path
) -> Qwen2VLImageProcessor:
    """Qwen2-VL and Qwen2.5-VL: ``max_pixels`` overrides the settings' bound on the resized
    area (``min_pixels`` is clamped not to exceed it)."""
    return Qwen2VLImageProcessor.from_config(config, max_pixels=max_pixels)


def clip_image_processor(
    config: dict[str, Any], hf_config: Any, max_pixels: int | None, model_path: str | Path
) -> CLIPImageProcessor:
    """LLaVA: fixed resolution (``max_pixels`` does not apply), ``llava_num_image_tokens``."""
    return CLIPImageProcessor.from_config(config, num_tokens=llava_num_image_tokens(hf_config))


def idefics3_image_processor(
    config: dict[str, Any], hf_config: Any, max_pixels: int | None, model_path: str | Path
) -> Idefics3ImageProcessor:
    """Idefics3 / SmolVLM: tiles of ``max_image_size`` (``max_pixels`` does not apply); the
    expansion's token ids from the checkpoint's ``tokenizer.json``.

    Raises:
        FileNotFoundError: the checkpoint has no ``tokenizer.json``.
        ValueError: the tokenizer lacks one of Idefics3's image tokens.
    """
    tokenizer_file = Path(model_path) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"Idefics3 needs the checkpoint's {tokenizer_file}.")
    tokens = Idefics3Tokens.from_tokenizer_file(tokenizer_file)
    return Idefics3ImageProcessor.from_config(config, tokens, image_seq_len(hf_config))


def internvl_image_processor(
    config: dict[str, Any], hf_config: Any, max_pixels: int | None, model_path: str | Path
) -> InternVLImageProcessor:
    """InternVL3: dynamic tiling into tiles of ``size`` (``max_pixels`` does not apply); the
    expansion's token ids from the checkpoint's tokenizer files.

    Raises:
        FileNotFoundError: the checkpoint has no ``tokenizer.json``.
        ValueError: the tokenizer lacks one of InternVL's image tokens, or bad settings.
    """
    tokens = InternVLTokens.from_tokenizer_files(model_path)
    return InternVLImageProcessor.from_config(config, tokens, internvl_image_seq_len(hf_config))


def llava_onevision_image_processor(
    config: dict[str, Any], hf_config: Any, max_pixels: int | None, model_path: str | Path
) -> LlavaOnevisionImageProcessor:
    """LLaVA-OneVision: anyres tiles of the tower's ``image_size`` (``max_pixels`` does not
    apply); features per tile side and ``anyres_max_N`` from the model config.

    Raises:
        ValueError: a select strategy other than "full", an unsupported
            ``vision_aspect_ratio``, or tile settings the tower cannot take.
    """
    strategy = config_get(hf_config, "vision_feature_select_strategy", "full")
    if strategy != "full":
        raise ValueError(
            f"LLaVA-OneVision supports the 'full' select strategy only, not {strategy!r}."
        )
    vision = config_get(hf_config, "vision_config")
    tile = int(config_get(vision, "image_size"))
    side = tile // int(config_get(vision, "patch_size"))
    tiles = max_tiles(config_get(hf_config, "vision_aspect_ratio", "anyres_max_9"))
    pinpoints = config_get(hf_config, "image_grid_pinpoints")  # where the settings lack them
    config = {"image_grid_pinpoints": pinpoints, **config}
    return LlavaOnevisionImageProcessor.from_config(config, tile, side, tiles)


def gemma3_image_processor(
    config: dict[str, Any], hf_config: Any, max_pixels: int | None, model_path: str | Path
) -> Gemma3ImageProcessor:
    """Gemma 3: the tower's fixed size (``max_pixels`` does not apply); the placeholder range
    ``<start_of_image>``, ``mm_tokens_per_image`` soft tokens, ``<end_of_image>`` (ids from
    the config, the placeholder's text from the checkpoint's ``tokenizer.json``).

    Raises:
        FileNotFoundError: the checkpoint has no ``tokenizer.json``.
    """
    from tokenizers import Tokenizer

    tokenizer_file = Path(model_path) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"Gemma 3 needs the checkpoint's {tokenizer_file}.")
    boi, eoi = config_get(hf_config, "boi_token_index"), config_get(hf_config, "eoi_token_index")
    image = config_get(hf_config, "image_token_index")
    token_ids = (boi, *[image] * config_get(hf_config, "mm_tokens_per_image"), eoi)
    placeholder = Tokenizer.from_file(str(tokenizer_file)).id_to_token(boi)
    return Gemma3ImageProcessor.from_gemma3_config(config, token_ids, placeholder)


def get_image_processor(
    model_path: str | Path,
    hf_config: Any,
    max_pixels: int | None = None,
    mm_processor_kwargs: dict[str, Any] | None = None,
) -> ImageProcessor:
    """The image processor of the checkpoint at ``model_path`` (a local folder), as its family
    (``mm_serve.checkpoint.families``) builds it from ``read_image_processor_config``'s
    settings, then ``mm_processor_kwargs`` applied (``ImageProcessor.with_kwargs``: the
    server's defaults; ``image_kwargs``).

    Raises:
        ValueError: a family without images, bad image processor settings, or
            ``mm_processor_kwargs`` the family does not take.
        FileNotFoundError: no image processor settings in the folder (see
            ``read_image_processor_config``).
    """
    family = find_family(hf_config)
    if family is None or family.image_processor is None:
        raise ValueError(
            f"No image processor for model type {config_get(hf_config, 'model_type')!r}; "
            f"supported: {', '.join(VLM_MODEL_TYPES)}."
        )
    if max_pixels is not None and max_pixels <= 0:
        raise ValueError(f"max_pixels must be positive, got {max_pixels}.")
    config = read_image_processor_config(model_path)
    processor = resolve(family.image_processor)(config, hf_config, max_pixels, model_path)
    return processor.with_kwargs(image_kwargs(mm_processor_kwargs, hf_config))


def image_kwargs(kwargs: dict[str, Any] | None, hf_config: Any) -> dict[str, Any]:
    """``mm_processor_kwargs`` for the image processor: without ``VIDEO_SAMPLING_KWARGS`` where
    the family takes videos (there they are the video processor's)."""
    family = find_family(hf_config)
    if family is None or family.video_processor is None:
        return dict(kwargs or {})
    return {k: v for k, v in (kwargs or {}).items() if k not in VIDEO_SAMPLING_KWARGS}
