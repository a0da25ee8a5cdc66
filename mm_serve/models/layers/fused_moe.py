"""The sparse mixture-of-experts MLP: a top-k router (softmax, or Llama 4's sigmoid) and the
experts' weights stacked for the fused MoE kernels (``mm_serve.kernels.moe``); Llama 4's block
adds a shared expert.

Under tensor parallelism every rank holds every expert, each cut along its intermediate
dimension (as the dense MLP: gate and up by output rows, down by input columns); the partial
outputs are summed by an all-reduce. Expert parallelism is not implemented.
"""

from __future__ import annotations

import torch
from torch import nn

from mm_serve.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from mm_serve.kernels import linear
from mm_serve.kernels.dispatch_moe import fused_experts
from mm_serve.kernels.moe import topk_sigmoid, topk_softmax
from mm_serve.models.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    copy_weight,
    divide,
)


class TopKRouter(nn.Module):
    """``weight [E, H]`` (replicated): each token's ``top_k`` experts by the logits
    ``x @ weight.T``: a softmax over them (``kernels.moe.topk_softmax``, ``renormalize`` as
    the checkpoint's ``norm_topk_prob``), or, ``sigmoid``, the largest logits' sigmoids
    (``topk_sigmoid``, Llama 4)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool = False,
        sigmoid: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.top_k, self.renormalize, self.sigmoid = top_k, renormalize, sigmoid

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> ``(topk_weights float32 [T, top_k], topk_ids int32 [T, top_k])``."""
        logits = linear(x, self.weight)
        if self.sigmoid:
            return topk_sigmoid(logits, self.top_k)
        return topk_softmax(logits, self.top_k, self.renormalize)


def _checkpoint_layout(tensor: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """``tensor`` as ``shape`` (``[E, out, in]``, ``F.linear``'s per expert): as it is, else
    with its last two dimensions swapped (the Qwen3-VL-MoE hub files' ``[E, in, out]``, which
    transformers transposes on load when the shapes differ; Llama 4's).

    Raises:
        ValueError: neither layout has ``shape``.
    """
    if tensor.shape == shape:
        return tensor
    if tensor.dim() == 3 and tensor.transpose(1, 2).shape == shape:
        return tensor.transpose(1, 2)
    raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, expected {shape}")


class FusedMoE(nn.Module):
    """The experts of one layer, this rank's slice of each: ``gate_up_proj [E, 2 I / tp, H]``
    (gate rows, then up rows) and ``down_proj [E, H, I / tp]``, named as transformers'
    ``Qwen3VLMoeTextExperts``. ``forward`` sums the routed experts' outputs over the ranks.

    Raises:
        ValueError: ``intermediate_size`` not divisible by the TP size.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.tp_rank, tp_size = get_tp_rank(), get_tp_size()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size  # of an expert, all ranks together
        inter = divide(intermediate_size, tp_size)
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden_size), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, inter), requires_grad=False
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        """Copy this rank's slice of the stacked checkpoint tensor ``loaded_weight`` (all
        experts, full width; either layout of ``_checkpoint_layout``) into ``param``.

        Raises:
            ValueError: a shape that fits neither layout.
        """
        e, h, full = self.num_experts, self.hidden_size, self.intermediate_size
        inter = param.shape[-1] if param is self.down_proj else param.shape[1] // 2
        start = self.tp_rank * inter
        if param is self.down_proj:
            weight = _checkpoint_layout(loaded_weight, (e, h, full))
            copy_weight(param.data, weight.narrow(2, start, inter))
            return
        weight = _checkpoint_layout(loaded_weight, (e, 2 * full, h))
        gate, up = weight.narrow(1, start, inter), weight.narrow(1, full + start, inter)
        copy_weight(param.data, torch.cat([gate, up], dim=1))

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, top_k] float32
        topk_ids: torch.Tensor,  # [T, top_k] int32
        weights_on_input: bool = False,
    ) -> torch.Tensor:
        """``[T, H]``: the routed experts' outputs weighted (their inputs, with
        ``weights_on_input``) and summed, all ranks' added."""
        w13, w2 = self.gate_up_proj, self.down_proj
        return tp_all_reduce(fused_experts(x, w13, w2, topk_weights, topk_ids, weights_on_input))


class SparseMoeBlock(nn.Module):
    """A sparse MoE MLP without a shared expert (Qwen3-MoE, Qwen3-VL-MoE; HF
    ``Qwen3VLMoeTextSparseMoeBlock``): ``gate`` (``TopKRouter``) and ``experts``
    (``FusedMoE``), ``[T, H] -> [T, H]``."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, renormalize)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.gate(x))


class GatedMLP(nn.Module):
    """``down_proj(silu(gate) * up)`` with ``[gate | up]`` from ``gate_up_proj`` (the dense
    MLP's layout and sharding; HF names ``gate_proj``, ``up_proj``, ``down_proj``)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), gated=True)


class SharedExpertMoeBlock(nn.Module):
    """Llama 4's MoE MLP (HF ``Llama4TextMoe``): ``router`` (``TopKRouter``, sigmoid: the top
    logits' sigmoids), ``experts`` (``FusedMoE``) fed each token scaled by its weight, plus
    ``shared_expert`` (``GatedMLP``), which every token goes through; ``[T, H] -> [T, H]``."""

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int
    ) -> None:
        super().__init__()
        self.router = TopKRouter(hidden_size, num_experts, top_k, sigmoid=True)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size)
        self.shared_expert = GatedMLP(hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.experts(x, *self.router(x), weights_on_input=True)
        return self.shared_expert(x) + routed
