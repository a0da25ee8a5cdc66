"""Quantized checkpoints: the scheme a checkpoint's ``quantization_config`` names, the linear
layers it quantized, and its tensors in our layout.

Loaded: compressed-tensors checkpoints (llmcompressor's) of one config group targeting
``Linear`` layers, and transformers' fine-grained FP8 (``quant_method: fp8``):

- FP8 (``format: float-quantized``): float8_e4m3fn ``weight`` with a per-channel
  ``weight_scale`` and activations quantized per token at run time (``dynamic``, strategy
  ``token``) or not at all; or 128 x 128 blocks (``weight_scale``, fine-grained FP8's
  ``weight_scale_inv``: ``[N / 128, K / 128]``) with activations quantized per token and group
  of 128;
- W4A16 (``format: pack-quantized``): int4 weights packed eight to an int32
  (``weight_packed``, ``weight_shape``), a ``weight_scale`` per row and group of input
  features, and, asymmetric, a ``weight_zero_point`` packed along the rows.

Anything else (another ``quant_method``, static activation scales, per-tensor or block
weight scales, other bit widths) raises ``UnsupportedQuantization`` naming it: a checkpoint is
never loaded as something it is not. Layers the checkpoint left unquantized (its ``ignore``
list: usually the vision tower and ``lm_head``) keep their float weights.

Our layout of a quantized linear layer, rows = output features, so every tensor shards with
the layer's weight (``layers.linear``):

- FP8: ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale`` float32 ``[N, 1]`` or, for
  blocks, ``[N, K / 128]`` (each block's scale on each of its rows);
- INT4: ``weight`` int8 ``[N, K]`` (-8..7), ``weight_scale`` ``[N, K / group]``, asymmetric
  also ``weight_zero_point`` int8 ``[N, K / group]``.

Kernels: ``kernels.quant_linear``. Source of the checkpoint format: compressed-tensors
(``compressors/pack_quantized``: values stored with a +8 offset, element ``i`` of a row at bit
``4 i`` of the packed row).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mm_serve.kernels.quant_linear import FP8_DTYPE, fp8_linear_ref, int4_linear_ref


class UnsupportedQuantization(ValueError):
    """The checkpoint's quantization is one this engine does not load."""


SUPPORTED = (
    "compressed-tensors FP8 (per-channel weights with dynamic per-token or no activation "
    "quantization; 128 x 128 blocks with dynamic per-group activations) and W4A16 "
    "(pack-quantized, group-wise, symmetric or asymmetric), and transformers' fine-grained FP8 "
    "(quant_method 'fp8', weight blocks, dynamic activations)"
)


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint's quantized linear layers hold their weights.

    ``weight_type``: "fp8" or "int4". ``group_size``: input features per weight scale (None:
    one scale per row). ``block_rows``: output features per row of the checkpoint's scales
    (FP8 blocks: 128; our layout repeats each over its rows). ``symmetric``: no zero point.
    ``input_group_size``: FP8 activations left as they are (0), quantized per token (None) or
    per token and group of that many features."""

    weight_type: str
    group_size: int | None = None
    block_rows: int = 1
    symmetric: bool = True
    input_group_size: int | None = 0

    def make_method(self) -> QuantLinearMethod:
        return Fp8LinearMethod(self) if self.weight_type == "fp8" else Int4LinearMethod(self)


def quant_scheme(hf_config: Any) -> QuantScheme | None:
    """The scheme of ``hf_config.quantization_config``; None when the checkpoint has none.

    Raises:
        UnsupportedQuantization: a method, format or scheme outside ``SUPPORTED``.
    """
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    if not isinstance(config, dict):
        config = config.to_dict()
    method = getattr(config.get("quant_method"), "value", config.get("quant_method"))  # enums
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(config)
    if method == "fp8":
        return _fine_grained_fp8_scheme(config)
    raise UnsupportedQuantization(
        f"Quantization method {method!r} is not supported; this engine loads {SUPPORTED}."
    )


def _fine_grained_fp8_scheme(config: dict) -> QuantScheme:
    """transformers' fine-grained FP8 (Qwen's and DeepSeek's FP8 releases): 128 x 128 weight
    blocks, activations quantized per token and group of 128 at run time."""
    block, activations = config.get("weight_block_size"), config.get("activation_scheme")
    if block is None or len(block) != 2 or activations != "dynamic":
        raise UnsupportedQuantization(
            f"FP8 with weight_block_size {block} and activation_scheme {activations!r} is not "
            f"supported; this engine loads {SUPPORTED}."
        )
    return QuantScheme("fp8", group_size=block[1], block_rows=block[0], input_group_size=block[1])


def _compressed_tensors_scheme(config: dict) -> QuantScheme:
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1 or groups[0].get("targets") != ["Linear"]:
        raise UnsupportedQuantization(
            "compressed-tensors checkpoints with other than one config group targeting "
            f"Linear layers are not supported; this one has {len(groups)}: {groups}."
        )
    fmt, weights = groups[0].get("format") or config.get("format"), groups[0].get("weights") or {}
    activations = groups[0].get("input_activations")
    kind = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
    if fmt == "float-quantized" and kind[:2] == ("float", 8):
        scheme = _fp8_scheme(weights, activations)
        if scheme is not None:
            return scheme
    if fmt == "pack-quantized" and kind == ("int", 4, "group") and activations is None:
        return QuantScheme("int4", weights["group_size"], symmetric=bool(weights["symmetric"]))
    raise UnsupportedQuantization(
        f"compressed-tensors format {fmt!r} with weights {weights} and input activations "
        f"{activations} is not supported; this engine loads {SUPPORTED}."
    )


def _fp8_scheme(weights: dict, activations: dict | None) -> QuantScheme | None:
    """compressed-tensors' FP8 weights per channel or per 2-D block, with activations left
    alone or quantized dynamically per token (channel) or per token group (block)."""
    dynamic = activations is not None and activations.get("dynamic") is True
    strategy = activations and activations.get("strategy")
    if weights.get("strategy") == "channel":
        if activations is None:
            return QuantScheme("fp8")
        if dynamic and strategy == "token":
            return QuantScheme("fp8", input_group_size=None)
    block = weights.get("block_structure")
    if weights.get("strategy") == "block" and dynamic and strategy == "group":
        group = activations["group_size"]
        if block is not None and block[1] == group:
            return QuantScheme("fp8", group_size=group, block_rows=block[0], input_group_size=group)
    return None


# ---- the layers ------------------------------------------------------------------------------


class QuantLinearMethod:
    """Gives a linear layer its quantized parameters (``create_weights``, on the layer's device,
    before the weights are loaded) and computes its output (``apply``)."""

    def __init__(self, scheme: QuantScheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


def _param(shape: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=like.device), requires_grad=False)


class Fp8LinearMethod(QuantLinearMethod):
    """FP8 weights with a scale per output row (and block of input features); W8A8 quantizes
    the input per token (and group)."""

    def create_weights(self, layer: nn.Module) -> None:
        rows, cols = layer.weight.shape
        group = self.scheme.group_size
        weight = layer.weight
        layer.weight = _param((rows, cols), FP8_DTYPE, weight)
        layer.weight_scale = _param(
            (rows, -(-cols // group) if group else 1), torch.float32, weight
        )

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        group = self.scheme.input_group_size
        return fp8_linear_ref(x, layer.weight, layer.weight_scale, bias, group)


class Int4LinearMethod(QuantLinearMethod):
    """INT4 weights with a scale (and zero point) per output row and group of inputs.

    Raises ``ValueError`` at ``create_weights`` when the layer's input features are not a
    whole number of groups."""

    def create_weights(self, layer: nn.Module) -> None:
        rows, cols = layer.weight.shape
        group = self.scheme.group_size
        if cols % group:
            raise ValueError(f"{cols} input features are not a multiple of the group {group}.")
        weight, dtype = layer.weight, layer.weight.dtype
        layer.weight = _param((rows, cols), torch.int8, weight)
        layer.weight_scale = _param((rows, cols // group), dtype, weight)
        if not self.scheme.symmetric:
            layer.weight_zero_point = _param((rows, cols // group), torch.int8, weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        zero_point = getattr(layer, "weight_zero_point", None)
        group = self.scheme.group_size
        return int4_linear_ref(x, layer.weight, layer.weight_scale, zero_point, group, bias)


def quantize_layers(model: nn.Module, scheme: QuantScheme, layer_names: Iterable[str]) -> None:
    """Give each linear layer of ``layer_names`` (our module names) ``scheme``'s parameters and
    method (``layer.quant_method``), before its weights are loaded.

    Raises:
        UnsupportedQuantization: a name that is not one of our tensor-parallel linear layers
            (e.g. a quantized vision tower).
    """
    for name in sorted(layer_names):
        layer = model.get_submodule(name) if name else None
        if not hasattr(layer, "quant_method"):  # layers.linear.LinearBase
            raise UnsupportedQuantization(
                f"The checkpoint quantizes {name!r}, which this engine keeps in floating point "
                "(only the language model's linear layers may be quantized)."
            )
        layer.quant_method = scheme.make_method()
        layer.quant_method.create_weights(layer)


# ---- checkpoint tensors -> our layout ----------------------------------------------------------

# One of these per quantized layer, in every format loaded.
QUANTIZED_LAYER_SUFFIXES = (".weight_scale", ".weight_scale_inv")


def canonical_weights(
    weights: Iterable[tuple[str, torch.Tensor]], scheme: QuantScheme
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors in our layout (module doc): packed int4 rows and zero points
    unpacked to int8, ``weight_shape`` dropped, FP8 weight scales as float32 ``weight_scale``
    repeated over their block's rows; others as they are."""
    for name, tensor in weights:
        if name.endswith(".weight_shape"):
            continue
        if name.endswith(".weight_packed"):
            yield name.removesuffix("_packed"), unpack_int4_rows(tensor)
        elif name.endswith(".weight_zero_point") and tensor.dtype == torch.int32:
            yield name, unpack_int4_rows(tensor.T.contiguous()).T.contiguous()
        elif name.endswith(QUANTIZED_LAYER_SUFFIXES) and scheme.weight_type == "fp8":
            scale = tensor.float().reshape(tensor.shape[0] if tensor.dim() else 1, -1)
            yield name.removesuffix("_inv"), scale.repeat_interleave(scheme.block_rows, dim=0)
        else:
            yield name, tensor


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C / 8]`` of eight 4-bit values per word (value ``i`` of a row at bit
    ``4 i``, stored with a +8 offset) -> int8 ``[R, C]`` of -8..7."""
    if packed.dtype != torch.int32:
        raise ValueError(f"Packed int4 tensors are int32, got {packed.dtype}.")
    rows = packed.shape[0]
    nibbles = packed.contiguous().view(torch.uint8).view(rows, -1)  # little-endian bytes
    values = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).reshape(rows, -1)
    return (values.to(torch.int16) - 8).to(torch.int8)
