"""The sparse mixture-of-experts MLP: a top-k softmax router and the experts' weights stacked
for the fused MoE kernels (``mm_serve.kernels.moe``).

Under tensor parallelism every rank holds every expert, each cut along its intermediate
dimension (as the dense MLP: gate and up by output rows, down by input columns); the partial
outputs are summed by an all-reduce. Expert parallelism is not implemented.
"""

from __future__ import annotations

import torch
from torch import nn

from mm_serve.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from mm_serve.kernels import linear
from mm_serve.kernels.moe import fused_experts, topk_softmax
from mm_serve.models.layers.linear import copy_weight, divide


class TopKRouter(nn.Module):
    """``weight [E, H]`` (replicated): each token's ``top_k`` experts by a softmax over
    ``x @ weight.T`` (``kernels.moe.topk_softmax``, ``renormalize`` as the checkpoint's
    ``norm_topk_prob``)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> ``(topk_weights float32 [T, top_k], topk_ids int32 [T, top_k])``."""
        return topk_softmax(linear(x, self.weight), self.top_k, self.renormalize)


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
    ) -> torch.Tensor:
        """``[T, H]``: the routed experts' outputs weighted and summed (all ranks')."""
        out = fused_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)
        return tp_all_reduce(out)


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
