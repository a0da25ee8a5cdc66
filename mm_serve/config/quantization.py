"""The quantization a checkpoint's ``quantization_config`` names, as a ``QuantScheme``; what
this engine does not load is refused here, in the front end, naming it (never loaded as
something it is not).

Loaded: compressed-tensors checkpoints (llmcompressor's) of one config group targeting
``Linear`` layers, FP8 (``format: float-quantized``: per-channel weights with activations
quantized per token at run time or not at all, or 128 x 128 weight blocks with activations
quantized per token and group of 128) and W4A16 (``format: pack-quantized``: int4 groups,
symmetric or with zero points); and transformers' fine-grained FP8 (``quant_method: fp8``,
weight blocks, dynamic activations). The layers and tensors: ``models.layers.quantization``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
    per token and group of that many features. ``online``: the checkpoint is float and the
    engine quantizes its weights as it loads them (``--quantization``)."""

    weight_type: str
    group_size: int | None = None
    block_rows: int = 1
    symmetric: bool = True
    input_group_size: int | None = 0
    online: bool = False  # quantized at load from the checkpoint's float weights


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


ONLINE_METHODS = ("fp8",)


def resolve_quantization(hf_config: Any, method: str | None) -> QuantScheme | None:
    """The checkpoint's scheme, or with ``method`` ("fp8", vLLM's ``--quantization fp8``) a
    float checkpoint's weights quantized at load: FP8 per output channel, activations per
    token at run time.

    Raises:
        UnsupportedQuantization: the checkpoint's quantization is not loaded (``quant_scheme``).
        ValueError: ``method`` is not one of ``ONLINE_METHODS``, or the checkpoint is
            quantized already.
    """
    scheme = quant_scheme(hf_config)
    if method is None:
        return scheme
    if method not in ONLINE_METHODS:
        raise ValueError(f"quantization={method!r} is not supported; choose from {ONLINE_METHODS}.")
    if scheme is not None:
        raise ValueError(
            f"The checkpoint is quantized already ({scheme.weight_type}); leave quantization unset."
        )
    return QuantScheme("fp8", input_group_size=None, online=True)
