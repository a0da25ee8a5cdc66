"""Quantized linear layers: the layers a checkpoint quantized get their parameters and
method (``quantize_layers``), and its tensors arrive in our layout (``canonical_weights``).
The scheme comes from ``config.quantization``.

Checkpoint tensors per quantized layer: FP8 float8_e4m3fn ``weight`` with ``weight_scale``
(per channel ``[N, 1]``, or per 128 x 128 block ``[N / 128, K / 128]``, fine-grained FP8's
``weight_scale_inv``); W4A16 int4 ``weight_packed`` (eight to an int32), ``weight_shape``,
``weight_scale`` per row and group of input features and, asymmetric, ``weight_zero_point``
packed along the rows. Layers the checkpoint left unquantized (its ``ignore`` list: usually the
vision tower and ``lm_head``) keep their float weights.

Our layout of a quantized linear layer, rows = output features, so every tensor shards with
the layer's weight (``layers.linear``):

- FP8: ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale`` float32 ``[N, 1]`` or, for
  blocks, ``[N, K / 128]`` (each block's scale on each of its rows);
- INT4: ``weight`` int8 ``[N, K]`` (-8..7), ``weight_scale`` ``[N, K / group]``, asymmetric
  also ``weight_zero_point`` int8 ``[N, K / group]``; on CUDA, once loaded
  (``process_quantized_weights``), uint8 ``[N, K / 2]`` packed two to a byte (``pack_int4``).
  FP8 blocks on CUDA also keep ``weight_scale_blocks`` ``[N / 128, K / 128]`` (each block's
  scale once) for cuBLASLt.

Kernels: ``kernels.dispatch_quant`` (references: ``kernels.quant_linear``). Source of the
checkpoints' packed format: compressed-tensors (``compressors/pack_quantized``: values stored
with a +8 offset, element ``i`` of a row at bit ``4 i`` of the packed row).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from mm_serve.kernels.dispatch_quant import fp8_linear, int4_linear
from mm_serve.kernels.quant_linear import FP8_DTYPE, pack_int4, quantize_weight

if TYPE_CHECKING:
    from mm_serve.config.quantization import QuantScheme


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

    def process_weights(self, layer: nn.Module) -> None:
        """Bring the loaded tensors into the kernels' layout (nothing by default)."""


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
        blocks = getattr(layer, "weight_scale_blocks", None)
        return fp8_linear(x, layer.weight, layer.weight_scale, bias, group, blocks)

    def process_weights(self, layer: nn.Module) -> None:
        """On CUDA, 128 x 128 blocks' scales once each, ``weight_scale_blocks`` ``[N / 128,
        K / 128]``, for cuBLASLt's block-scaled GEMM (when both sides are whole blocks)."""
        rows, cols = layer.weight.shape
        blocks = self.scheme.block_rows == self.scheme.group_size == 128
        if layer.weight.is_cuda and blocks and rows % 128 == 0 and cols % 128 == 0:
            compact = layer.weight_scale.data[::128].contiguous()
            layer.weight_scale_blocks = nn.Parameter(compact, requires_grad=False)


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
        return int4_linear(x, layer.weight, layer.weight_scale, zero_point, group, bias)

    def process_weights(self, layer: nn.Module) -> None:
        """On CUDA, the weight packed two values to a byte for the Triton GEMM
        (``pack_int4``)."""
        if layer.weight.is_cuda:
            packed = pack_int4(layer.weight.data, self.scheme.group_size)
            layer.weight = nn.Parameter(packed, requires_grad=False)


def quantize_layers(model: nn.Module, scheme: QuantScheme, layer_names: Iterable[str]) -> None:
    """Give each linear layer of ``layer_names`` (our module names) ``scheme``'s parameters and
    method (``layer.quant_method``), before its weights are loaded.

    Raises:
        ValueError: a name that is not one of our tensor-parallel linear layers (e.g. a
            quantized vision tower).
    """
    for name in sorted(layer_names):
        try:
            layer = model.get_submodule(name)
        except AttributeError:
            layer = None  # a module of the checkpoint's that this model names otherwise
        if not hasattr(layer, "quant_method"):  # layers.linear.LinearBase
            raise ValueError(
                f"The checkpoint quantizes {name!r}, which this engine keeps in floating point "
                "(only the language model's linear layers may be quantized)."
            )
        layer.quant_method = _method(scheme)
        layer.quant_method.create_weights(layer)


def _method(scheme: QuantScheme) -> QuantLinearMethod:
    return (Fp8LinearMethod if scheme.weight_type == "fp8" else Int4LinearMethod)(scheme)


@torch.no_grad()
def quantize_loaded_layers(model: nn.Module, scheme: QuantScheme) -> None:
    """Quantize the loaded float weight of every language-model linear layer (ours under
    ``model.``; not the vision tower, not ``lm_head``) as ``scheme`` says
    (``quant_linear.quantize_weight``), each rank its own rows: online FP8 (vLLM's
    ``--quantization fp8``) and random weights for a quantized config (``load_format
    dummy``)."""
    for name, layer in model.named_modules():
        if name.startswith("model.") and hasattr(layer, "quant_method"):
            tensors = quantize_weight(
                layer.weight.data,
                scheme.weight_type,
                scheme.group_size,
                scheme.block_rows,
                scheme.symmetric,
            )
            for key, tensor in tensors.items():
                setattr(layer, key, nn.Parameter(tensor, requires_grad=False))
            layer.quant_method = _method(scheme)


def process_quantized_weights(model: nn.Module) -> None:
    """Every quantized layer's tensors into its kernels' layout, once loaded."""
    for layer in model.modules():
        if getattr(layer, "quant_method", None) is not None:
            layer.quant_method.process_weights(layer)


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
            scale = tensor.float().reshape(tensor.shape[0], -1)  # [N] or [N, 1]: [N, 1]
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
