"""The pooling runner's settings: how a prompt's final hidden states become its embedding.

A checkpoint served with ``runner="pooling"`` (vLLM's ``--runner pooling``, formerly ``--task
embed``) answers embeddings instead of generating. Its ``PoolerConfig`` is resolved as vLLM
resolves it for a generative architecture converted to an embedding model: last-token pooling
with L2 normalisation, unless the checkpoint is a sentence-transformers folder
(``modules.json`` naming a ``Pooling`` module whose ``config.json`` sets a
``pooling_mode_*``; normalised only when a ``Normalize`` module follows), and each key of
``pooler_config`` (vLLM's ``--pooler-config``, JSON) replaces what was read. Matryoshka
truncation (a request's ``dimensions``) is allowed only when ``config.json`` says the model was
trained for it (``is_matryoshka``, ``matryoshka_dimensions``), as in vLLM.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

POOLING_TYPES = ("LAST", "MEAN")
RUNNERS = ("auto", "generate", "pooling")
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# sentence-transformers' pooling_mode_* keys that name a pooling type served here.
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN"}


@dataclass(frozen=True)
class PoolerConfig:
    """``pooling_type``: "LAST" (the last prompt token's hidden state) or "MEAN" (the mean
    over the prompt's tokens, image tokens included); ``normalize``: L2-normalise the result
    (a request's ``normalize`` may override it); ``matryoshka_dimensions``: the sizes a
    request's ``dimensions`` may take (None: any size up to the hidden size, if
    ``is_matryoshka``)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {POOLING_TYPES}, not {self.pooling_type!r}."
            )


def resolve_runner(runner: str) -> str:
    """``auto`` -> "generate" (every architecture served here is generative; an embedding
    checkpoint of one, e.g. GME-Qwen2-VL, needs ``runner="pooling"``, as in vLLM).

    Raises:
        ValueError: not one of ``RUNNERS``.
    """
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, not {runner!r}.")
    return "generate" if runner == "auto" else runner


def resolve_pooler_config(
    path: str, hf_config: Any, overrides: dict[str, Any] | None
) -> PoolerConfig:
    """The checkpoint folder ``path``'s pooler settings (see the module docstring), then
    ``overrides``' keys ("pooling_type", "normalize").

    Raises:
        ValueError: an unknown key in ``overrides`` or an unsupported pooling type.
    """
    settings = sentence_transformers_pooling(Path(path))
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(f"Unknown pooler_config keys {unknown}; expected pooling_type, normalize.")
    if isinstance(overrides.get("pooling_type"), str):
        overrides["pooling_type"] = overrides["pooling_type"].upper()
    settings |= overrides
    dimensions = getattr(hf_config, "matryoshka_dimensions", None)
    config = PoolerConfig(
        **settings,
        is_matryoshka=bool(dimensions) or bool(getattr(hf_config, "is_matryoshka", False)),
        matryoshka_dimensions=tuple(dimensions) if dimensions else None,
    )
    logger.info("Pooling runner: %s", config)
    return config


def sentence_transformers_pooling(path: Path) -> dict[str, Any]:
    """``{"pooling_type", "normalize"}`` of a sentence-transformers folder (``modules.json``
    with a ``Pooling`` module), ``{}`` when ``path`` is none.

    Raises:
        ValueError: its pooling mode is not one served here (``POOLING_TYPES``).
    """
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return {}
    modules = json.loads(modules_file.read_text())
    pooling = next((m for m in modules if m.get("type") == _ST_POOLING), None)
    if pooling is None:
        return {}
    settings = json.loads((path / pooling["path"] / "config.json").read_text())
    modes = [key for key, value in settings.items() if key.startswith("pooling_mode_") and value]
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(
            f"The checkpoint's sentence-transformers pooling {modes} is not served; "
            f"expected one of {sorted(_ST_MODES)}."
        )
    normalize = any(m.get("type") == _ST_NORMALIZE for m in modules)
    return {"pooling_type": _ST_MODES[modes[0]], "normalize": normalize}
