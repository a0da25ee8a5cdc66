"""Find a checkpoint (a local folder or a Hugging Face Hub id), read its ``config.json``, and
resolve the dtype and the context length it implies.

What resolving the config needs of a checkpoint, apart from the model loader
(``mm_serve.models.loader``), so that the config imports nothing of the models.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

# What serving needs from a hub repo: configs, weights, tokenizer and chat template files.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


# torch's names of them: "float" is float32, "half" float16.
_STR_TO_DTYPE = {n: getattr(torch, n) for n in ("float32", "float", "float16", "half", "bfloat16")}


class ModelLoadError(ValueError):
    """The checkpoint cannot be found or does not fit the model; the message says why."""


def resolve_model_path(model: str, revision: str | None = None) -> str:
    """An existing folder -> its absolute path; otherwise a hub id, downloaded (or found in the
    HF cache) with ``snapshot_download``. Raises ``ModelLoadError`` if neither works."""
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return os.path.abspath(path)
    if model.startswith((".", "/", "~")):
        raise ModelLoadError(f"Model folder {model!r} does not exist.")
    from huggingface_hub import constants, snapshot_download

    try:
        return snapshot_download(model, revision=revision, allow_patterns=ALLOW_PATTERNS)
    except Exception as e:  # offline, unknown repo, gated, bad id: all mean "not available"
        env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
        offline = constants.HF_HUB_OFFLINE or env in ("1", "ON", "YES", "TRUE")
        hint = (
            "HF_HUB_OFFLINE is set and it is not in the local HF cache"
            if offline
            else "the Hugging Face Hub could not be reached or has no such repo/revision, "
            "and it is not in the local HF cache"
        )
        raise ModelLoadError(
            f"Cannot find model {model!r}"
            + (f" (revision {revision!r})" if revision else "")
            + f": it is not a local folder, and {hint} ({type(e).__name__}: {e}). "
            "Pass the path of a downloaded checkpoint folder instead."
        ) from e


def load_hf_config(path: str) -> Any:
    """The checkpoint's ``config.json`` as a transformers config (no remote code)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"No config.json in {path!r}: not a Hugging Face checkpoint folder.")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def resolve_dtype(
    dtype: str, text_config: Any, hf_config: Any, device: torch.device
) -> torch.dtype:
    """``auto`` takes the checkpoint's dtype (float32 stays float32), else the named one."""
    if dtype != "auto":
        if dtype not in _STR_TO_DTYPE:
            raise ValueError(f"Unknown dtype {dtype!r}; choose from {sorted(_STR_TO_DTYPE)}.")
        return _STR_TO_DTYPE[dtype]
    found = getattr(text_config, "dtype", None) or getattr(hf_config, "dtype", None)
    if isinstance(found, str):
        found = _STR_TO_DTYPE.get(found)
    if found is None:
        found = torch.bfloat16 if device.type == "cuda" else torch.float32
    return found


def resolve_max_model_len(text_config: Any, requested: int | None) -> int:
    """``requested``, else the checkpoint's ``max_position_embeddings`` (4096 if unset); a
    request beyond it is kept, with a warning."""
    limit = getattr(text_config, "max_position_embeddings", None) or 4096
    if requested is None:
        return limit
    if requested > limit:
        logger.warning(
            "max_model_len %d exceeds the model's max_position_embeddings %d", requested, limit
        )
    return requested


def load_generation_config(path: str):
    """The checkpoint's ``generation_config.json``, or None when it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return None


def eos_token_ids(eos_token_id: int | None, generation_config: Any) -> list[int]:
    """The tokenizer's EOS id, then the other EOS ids of ``generation_config`` (a
    ``GenerationConfig`` or None): every id that ends a completion, as in vLLM."""
    eos = getattr(generation_config, "eos_token_id", None) if generation_config else None
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    first = [] if eos_token_id is None else [eos_token_id]
    return first + [t for t in eos if t != eos_token_id]
