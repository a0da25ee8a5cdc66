"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B, -235B-A22B): Qwen3-VL (``models.qwen3_vl``: the tower,
DeepStack, interleaved M-RoPE) with a mixture-of-experts MLP in the LM's sparse layers.

A layer is sparse unless it is in ``mlp_only_layers`` or ``(index + 1)`` is not a multiple of
``decoder_sparse_step`` (HF ``Qwen3VLMoeTextDecoderLayer``); a sparse layer's MLP is
``SparseMoeBlock``: softmax top-``num_experts_per_tok`` routing over ``num_experts`` experts of
width ``moe_intermediate_size``, the weights renormalised to sum to 1 (HF
``Qwen3VLMoeTextTopKRouter`` always does; the config has no ``norm_topk_prob``), no shared
expert. Dense layers keep the gated MLP of ``intermediate_size``.

Checkpoint names: Qwen3-VL's, plus ``model.language_model.layers.{i}.mlp.gate.weight``
(``[E, H]``) and the experts stacked, ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``,
in either layout: ``[E, 2 I, H]`` and ``[E, H, I]`` (what transformers 5 writes) or transposed
(the hub's files), see ``layers.fused_moe.FusedMoE.weight_loader``."""

from __future__ import annotations

from typing import Any

from torch import nn

from mm_serve.models.layers.fused_moe import SparseMoeBlock
from mm_serve.models.qwen3_vl import Qwen3VLForConditionalGeneration


def is_sparse_layer(config: Any, layer_index: int) -> bool:
    """Whether layer ``layer_index`` of the text ``config`` has the MoE MLP (HF's rule)."""
    if layer_index in (getattr(config, "mlp_only_layers", None) or ()):
        return False
    step = getattr(config, "decoder_sparse_step", 1)
    return config.num_experts > 0 and (layer_index + 1) % step == 0


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL with ``SparseMoeBlock`` MLPs in the sparse layers; ``config`` is the HF
    ``Qwen3VLMoeConfig``. Everything else, loading included, is Qwen3-VL's.

    Raises:
        ValueError: a ``hidden_act`` other than silu.
    """

    def make_mlp(self, config: Any, layer_index: int) -> nn.Module | None:
        if not is_sparse_layer(config, layer_index):
            return None  # the gated MLP of intermediate_size
        if config.hidden_act != "silu":
            raise ValueError(f"Unsupported hidden_act {config.hidden_act!r}; only silu is.")
        return SparseMoeBlock(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            renormalize=getattr(config, "norm_topk_prob", True),
        )
