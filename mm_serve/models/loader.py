"""Find a checkpoint (local folder or Hugging Face Hub id) and load it into a model.

The model is built on the ``meta`` device in the model dtype (no memory, no init), then
materialised on the target device with ``to_empty`` and filled in place: from the safetensors
shards, one tensor at a time (``load_format="auto"``), or with seeded random values drawn on
the device (``load_format="dummy"``, vLLM's name: benchmarks of real architectures from their
``config.json`` alone, no weight files needed).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from mm_serve.checkpoint.families import get_family, resolve
from mm_serve.checkpoint.hub import ModelLoadError
from mm_serve.config import ModelConfig
from mm_serve.models.interface import LanguageModel
from mm_serve.models.layers.quantization import (
    QUANTIZED_LAYER_SUFFIXES,
    canonical_weights,
    process_quantized_weights,
    quantize_layers,
    quantize_loaded_layers,
)

logger = logging.getLogger(__name__)


def get_model_class(hf_config: Any) -> type[LanguageModel]:
    """The model class of ``hf_config``'s family (``families.get_family``); ``ValueError``
    naming the supported architectures when there is none."""
    return resolve(get_family(hf_config).model_class)


def safetensors_files(path: str) -> list[str]:
    """The weight shards: those named by ``model.safetensors.index.json``, else every
    ``*.safetensors`` in the folder. Raises ``ModelLoadError`` if there are none."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelLoadError(f"Shards listed in {index!r} are missing: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"No *.safetensors weights in {path!r} (.bin is not supported).")
    return files


def iterate_weights(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of every shard, on the CPU.

    safetensors maps each file: a tensor reads its pages only when touched, so a
    tensor-parallel rank whose ``weight_loader`` copies out its slice reads only that slice's
    pages into its resident memory, and the pages are the OS's, shared by all ranks.
    """
    for file in tqdm(files, desc="Loading safetensors shards", disable=len(files) == 1):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


LOAD_FORMATS = ("auto", "dummy")
DUMMY_STD = 0.02  # std of random matrices, the usual ``initializer_range``


def load_model(model_config: ModelConfig, device: torch.device | str) -> nn.Module:
    """Build the checkpoint's model on ``device`` in ``model_config.dtype`` and fill its weights
    as ``model_config.load_format`` says ("auto": the safetensors; "dummy": random).

    Raises ``ValueError`` for an unknown load format, an unsupported architecture or a tensor
    of the wrong shape, and ``ModelLoadError`` listing every parameter no checkpoint tensor
    filled.
    """
    if model_config.load_format not in LOAD_FORMATS:
        raise ValueError(
            f"Unknown load_format {model_config.load_format!r}; choose from "
            f"{', '.join(LOAD_FORMATS)} (dummy: random weights, no weight files read)."
        )
    model_cls = get_model_class(model_config.hf_config)
    scheme = model_config.quant_scheme
    if model_config.load_format == "dummy":
        model = build_empty_model(model_cls, model_config, device)
        initialize_dummy_weights(model, model_config.seed)
        if scheme is not None:  # random float weights, quantized as the config says
            quantize_loaded_layers(model, scheme)
            process_quantized_weights(model)
        return model.eval()
    files = safetensors_files(model_config.path)
    stored = scheme is not None and not scheme.online  # the checkpoint holds quantized tensors
    quantize = None
    if stored:
        quantize = lambda model: quantize_layers(model, scheme, quantized_layers(model, files))  # noqa: E731
    model = build_empty_model(model_cls, model_config, device, quantize)
    weights = iterate_weights(files)
    with torch.no_grad():
        loaded = model.load_weights(canonical_weights(weights, scheme) if stored else weights)
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if missing:
        raise ModelLoadError(
            f"{len(missing)} parameters of {model_cls.__name__} were not found in the "
            f"checkpoint {model_config.path!r}: {', '.join(missing)}"
        )
    if scheme is not None and scheme.online:
        quantize_loaded_layers(model, scheme)
    process_quantized_weights(model)
    return model.eval()


def quantized_layers(model: nn.Module, files: list[str]) -> set[str]:
    """Our names of the linear layers the checkpoint quantized: those with a weight scale
    (``quantization.QUANTIZED_LAYER_SUFFIXES``), read from the shards' headers."""
    names = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if key.endswith(QUANTIZED_LAYER_SUFFIXES):
                    names.add(model.param_name(key).rpartition(".")[0])
    return names


def build_empty_model(
    model_cls: type[nn.Module],
    model_config: ModelConfig,
    device: torch.device | str,
    quantize: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """``model_cls`` built on ``meta`` (then ``quantize``d there: its quantized layers get
    their parameters) and materialised on ``device`` in the model dtype, its parameters
    uninitialised, tied embeddings re-tied and rotary tables recomputed."""
    with _default_dtype(model_config.dtype), torch.device("meta"):
        model = model_cls(model_config.hf_config)
        if quantize is not None:
            quantize(model)
    model.to_empty(device=device)
    if getattr(model, "tie_word_embeddings", False):  # to_empty gives each module its tensor
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():  # non-persistent buffers (rotary tables) are garbage now
        if hasattr(module, "rebuild_buffers"):
            module.rebuild_buffers()
    return model


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 0, std: float = DUMMY_STD) -> None:
    """Fill every parameter in place, on its own device: norm weights 1, biases 0, everything
    else N(0, ``std``) from a generator seeded with ``seed`` (same seed, same weights on one
    device type). A tied parameter is filled once."""
    generators: dict[torch.device, torch.Generator] = {}
    seen: set[int] = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if name == "bias":
                param.zero_()
            elif isinstance(module, nn.LayerNorm) or "Norm" in type(module).__name__:
                param.fill_(1.0)
            else:
                if param.device not in generators:
                    generators[param.device] = torch.Generator(param.device).manual_seed(seed)
                param.normal_(0.0, std, generator=generators[param.device])
