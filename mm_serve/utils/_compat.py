"""Workarounds for broken third-party installs, applied once at import time.

On a CPU-only host the registry's torchvision wheel is a CUDA build: its ``_C.so`` fails to
load, yet ``torchvision/_meta_registrations.py`` registers fake kernels for
``torchvision::nms`` / ``qnms``, so ``import torchvision`` (and every transformers image
processor) dies with "operator torchvision::nms does not exist". The fix defines those two
operator schemas (no kernels) before torchvision is imported; image transforms work, and
``torchvision.ops.nms`` raises torchvision's own "Couldn't load custom C++ ops"."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Schemas as torchvision's C++ sources declare them (csrc/ops/nms.cpp, quantized/qnms).
_TORCHVISION_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}

# The Library object owns the definitions: dropping it would unregister them.
_torchvision_lib = None
_checked = False


def ensure_torchvision_importable() -> None:
    """Make ``import torchvision`` work on a CPU host with a CUDA-only torchvision wheel.

    Call before anything imports torchvision (``mm_serve/__init__.py`` does, so does
    ``mm_serve.encoders``). A no-op when torchvision is absent, already imported, or its C
    extension loads (a GPU host, a matching CPU wheel). Idempotent and cheap to call again.
    Never raises: a failure is logged at debug level and ``import torchvision`` then fails
    as it would have.
    """
    global _checked
    if _checked or "torchvision" in sys.modules:
        return
    _checked = True
    try:
        spec = importlib.util.find_spec("torchvision")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return
    import torch

    if _load_extension(torch, Path(next(iter(spec.submodule_search_locations)))):
        return
    _define_missing_schemas(torch)


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that finds nothing: the first time torchvision is looked
    for, it leaves ``sys.meta_path`` and runs ``ensure_torchvision_importable``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname == "torchvision":
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(self)
            ensure_torchvision_importable()


def ensure_torchvision_importable_on_import() -> None:
    """Run ``ensure_torchvision_importable`` just before torchvision is first imported (at
    once if it already is), so that importing ``mm_serve`` does not import torch."""
    if "torchvision" in sys.modules:
        ensure_torchvision_importable()
    elif not any(isinstance(finder, _BeforeTorchvision) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())


def _load_extension(torch, package_dir: Path) -> bool:
    """Load ``torchvision/_C`` as torchvision itself would; True when it loaded."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = package_dir / f"_C{suffix}"
        if not path.is_file():
            continue
        try:
            torch.ops.load_library(str(path))
        except (OSError, RuntimeError) as e:
            logger.debug("torchvision C extension %s does not load: %s", path, e)
            return False
        logger.debug("torchvision C extension loaded from %s", path)
        return True
    logger.debug("no torchvision C extension found in %s", package_dir)
    return False


def _has_op(torch, name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _define_missing_schemas(torch) -> None:
    """Define the ops torchvision's import registers fake kernels for, without kernels."""
    global _torchvision_lib
    missing = [name for name in _TORCHVISION_SCHEMAS if not _has_op(torch, name)]
    if not missing:
        return
    try:
        if _torchvision_lib is None:
            _torchvision_lib = torch.library.Library("torchvision", "DEF")
        for name in missing:
            _torchvision_lib.define(_TORCHVISION_SCHEMAS[name])
    except RuntimeError as e:
        logger.debug("could not define torchvision op schemas: %s", e)
        return
    logger.debug(
        "torchvision's C extension is unusable here (CUDA build on a CPU host); defined "
        "schemas for %s so that torchvision.transforms imports",
        ", ".join(f"torchvision::{name}" for name in missing),
    )
