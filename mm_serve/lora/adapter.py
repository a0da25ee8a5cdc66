"""A PEFT LoRA adapter read into our layers' layout, checked against the model first.

``peft``'s ``save_pretrained`` writes ``adapter_config.json`` and ``adapter_model.safetensors``
whose tensors are ``base_model.model.<module>.lora_A.weight`` (``[r, in]``) and
``...lora_B.weight`` (``[out, r]``), ``<module>`` the HF model's module name
(``model.language_model.layers.0.self_attn.q_proj``, ``model.visual.blocks.0.attn.qkv``). The
layer computes ``y = W x + scaling * B (A x)`` with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``; ``alpha_pattern`` overrides the alpha per
module as peft matches it).

Our fused layers hold several HF modules as output slices (``qkv_proj``: q, k, v;
``gate_up_proj``: gate, up), as vLLM's do: each slice keeps its own ``(A, B)`` pair, and a slice
the adapter does not target has none. ``scaling`` is folded into ``B`` here (vLLM's
``optimize``), so the kernels add ``B (A x)``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mm_serve.lora.request import LoRAAdapterError, LoRARequest
from mm_serve.models.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
)
from mm_serve.models.llama import STACKED_PARAMS

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# The slice of a fused layer each stacked checkpoint module fills (``llama.STACKED_PARAMS``).
_SLICE_INDEX = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1}
# adapter_config.json fields that change the forward in ways these layers do not compute.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save (fully trained copies of layers)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    "lora_bias": "lora_bias",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters",
    "layer_replication": "layer_replication",
}

# One slice's pair: (A [r, in], B [out, r] with the scaling folded in).
SliceWeights = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LoRATarget:
    """A linear layer of our model that an adapter may target: its input width, the output
    widths of its slices (q/k/v, gate/up, or one) and whether it is in the vision tower or
    projector (run by ``embed_images``) rather than the language model."""

    name: str
    input_size: int
    slice_sizes: tuple[int, ...]
    tower: bool


@dataclass(frozen=True)
class ModelLoRATargets:
    """The LoRA-able layers of one model (``of``) and how an HF module name maps onto them."""

    targets: dict[str, LoRATarget]  # our module name -> target
    rename: Callable[[str], str]  # the model's checkpoint-name mapping

    @classmethod
    def of(cls, model: nn.Module) -> ModelLoRATargets:
        """The targets of ``model`` (built on any device, ``meta`` included): the language
        model's ``LinearBase`` layers (``model.*``) and every other ``nn.Linear`` (the tower's
        and projector's)."""
        targets = {}
        for name, module in model.named_modules():
            lm = name.startswith("model.")
            if lm and isinstance(module, LinearBase):
                targets[name] = LoRATarget(name, module.weight.shape[1], _slices(module), False)
            elif not lm and not name.startswith("lm_head") and isinstance(module, nn.Linear):
                targets[name] = LoRATarget(name, module.in_features, (module.out_features,), True)
        return cls(targets, getattr(model, "rename", lambda name: name))

    def locate(self, hf_module: str) -> tuple[LoRATarget, int]:
        """``(target, slice index)`` of an HF module name.

        Raises:
            LoRAAdapterError: the module is none of our LoRA-able layers.
        """
        name, index = self.rename(hf_module), 0
        if name.startswith("model."):
            for fused, part, shard_id in STACKED_PARAMS:
                if name.endswith(f".{part}"):
                    name, index = name[: -len(part)] + fused, _SLICE_INDEX[shard_id]
                    break
        target = self.targets.get(name)
        if target is None:
            raise LoRAAdapterError(
                f"The adapter targets {hf_module!r}, which this engine cannot serve with LoRA "
                "(it serves the language model's q/k/v/o/gate/up/down projections and the "
                "vision tower's and projector's linear layers), or which this base model "
                "does not have."
            )
        return target, index


def _slices(layer: LinearBase) -> tuple[int, ...]:
    if isinstance(layer, QKVParallelLinear):
        return (layer.q_size, layer.kv_size, layer.kv_size)
    if isinstance(layer, MergedColumnParallelLinear):
        return tuple(size // layer.tp_size for size in layer.output_sizes)
    return (layer.weight.shape[0],)


@dataclass(frozen=True)
class LoRAAdapter:
    """A loaded adapter on the CPU: per targeted layer (our module name) one entry per slice,
    ``(A [r, in], scaling * B [out, r])`` or None for a slice it does not target. ``rank``
    is the largest ``r`` of its layers; ``targets_tower``: it changes image embeddings."""

    lora_int_id: int
    rank: int
    layers: dict[str, tuple[SliceWeights | None, ...]]
    targets_tower: bool


def load_adapter(
    request: LoRARequest, targets: ModelLoRATargets, max_lora_rank: int
) -> LoRAAdapter:
    """Read and check the adapter folder of ``request``; everything is checked before
    anything is returned, so a refused adapter leaves nothing behind.

    Raises:
        LoRAAdapterError: no such folder or files, a non-LoRA or unsupported PEFT config, a
            rank above ``max_lora_rank``, a module we cannot serve, or tensors whose shapes
            belong to another base model.
    """
    config = read_adapter_config(request.lora_path)
    check_adapter_config(config, max_lora_rank)
    pairs = _module_pairs(_read_tensors(request.lora_path))
    layers: dict[str, list[SliceWeights | None]] = {}
    rank = 0
    for module, (lora_a, lora_b) in sorted(pairs.items()):
        target, index = targets.locate(module)
        _check_shapes(module, target, index, lora_a, lora_b, max_lora_rank)
        r = lora_a.shape[0]
        rank = max(rank, r)
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        slices = layers.setdefault(target.name, [None] * len(target.slice_sizes))
        slices[index] = (lora_a.float(), lora_b.float() * scaling)
    tower = any(targets.targets[name].tower for name in layers)
    frozen = {name: tuple(slices) for name, slices in layers.items()}
    return LoRAAdapter(request.lora_int_id, rank, frozen, tower)


def read_adapter_config(path: str) -> dict[str, Any]:
    """The folder's ``adapter_config.json`` as a dict (LoRAAdapterError if unreadable)."""
    file = os.path.join(os.path.expanduser(path), CONFIG_FILE)
    try:
        with open(file) as f:
            config = json.load(f)
    except OSError as e:
        raise LoRAAdapterError(f"Cannot read the LoRA adapter's {file!r}: {e.strerror}.") from e
    except json.JSONDecodeError as e:
        raise LoRAAdapterError(f"{file!r} is not JSON: {e}") from e
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{file!r} holds no JSON object.")
    return config


def check_adapter_config(config: dict[str, Any], max_lora_rank: int) -> None:
    """Raises LoRAAdapterError for a config that is not plain LoRA, or whose ``r`` (or any
    ``rank_pattern`` rank) is above ``max_lora_rank``."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"Only LoRA adapters are served, not {config.get('peft_type')}.")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise LoRAAdapterError(f"This engine does not serve LoRA adapters with {what}.")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError("This engine does not serve LoRA adapters with trained biases.")
    if not isinstance(config.get("r"), int) or "lora_alpha" not in config:
        raise LoRAAdapterError("adapter_config.json needs an int r and a lora_alpha.")
    ranks = [config["r"], *(config.get("rank_pattern") or {}).values()]
    if max(ranks) > max_lora_rank:
        raise LoRAAdapterError(
            f"The adapter's rank {max(ranks)} is above max_lora_rank={max_lora_rank}; "
            "start the engine with a larger max_lora_rank."
        )


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = os.path.join(os.path.expanduser(path), WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise LoRAAdapterError(f"No {WEIGHTS_FILE} in {path!r} (peft's save_pretrained writes it).")
    try:
        return load_file(file)
    except SafetensorError as e:
        raise LoRAAdapterError(f"{file!r} is not a safetensors file: {e}") from e


def _module_pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, ...]]:
    """HF module name -> ``(lora_A [r, in], lora_B [out, r])`` of the checkpoint's tensors.

    Raises:
        LoRAAdapterError: a tensor that is not a LoRA A or B weight, or a module without both.
    """
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.(lora_[AB])(?:\.\w+)?\.weight", key)
        if match is None:
            raise LoRAAdapterError(f"The adapter holds {key!r}, which is no LoRA A or B weight.")
        halves.setdefault(match[1], {})[match[2]] = tensor
    incomplete = [module for module, pair in halves.items() if len(pair) != 2]
    if incomplete:
        raise LoRAAdapterError(f"The adapter lacks lora_A or lora_B of {incomplete[0]!r}.")
    if not halves:
        raise LoRAAdapterError("The adapter holds no LoRA weights.")
    return {module: (pair["lora_A"], pair["lora_B"]) for module, pair in halves.items()}


def _check_shapes(
    module: str,
    target: LoRATarget,
    index: int,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    max_lora_rank: int,
) -> None:
    """Raises LoRAAdapterError when A or B does not fit the target slice: another base
    model (its widths differ) or a rank above ``max_lora_rank``."""
    expected_a = (lora_a.shape[0], target.input_size)
    expected_b = (target.slice_sizes[index], lora_a.shape[0])
    if lora_a.dim() != 2 or tuple(lora_a.shape) != expected_a or tuple(lora_b.shape) != expected_b:
        raise LoRAAdapterError(
            f"The adapter's {module!r} has A {tuple(lora_a.shape)} and B "
            f"{tuple(lora_b.shape)}; this base model needs A [r, {target.input_size}] and B "
            f"[{target.slice_sizes[index]}, r]: it was made for another base model."
        )
    if lora_a.shape[0] > max_lora_rank:
        raise LoRAAdapterError(
            f"The adapter's {module!r} has rank {lora_a.shape[0]}, above "
            f"max_lora_rank={max_lora_rank}."
        )


def _pattern_value(pattern: dict[str, Any], module: str, default: Any) -> Any:
    """peft's per-module override: the value of the first key that matches the end of the
    module name at a dot boundary (``peft.utils.other.get_pattern_key``), else ``default``."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default
