"""Which class serves a checkpoint: its family's (``mm_serve.checkpoint.families``) model class."""

from __future__ import annotations

from typing import Any

from mm_serve.checkpoint.families import get_family, resolve
from mm_serve.models.interface import LanguageModel


def get_model_class(hf_config: Any) -> type[LanguageModel]:
    """The model class of ``hf_config``'s family (``families.get_family``); ``ValueError``
    naming the supported architectures when there is none."""
    return resolve(get_family(hf_config).model_class)
