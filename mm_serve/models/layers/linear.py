"""Tensor-parallel linear layers (Megatron style, as nano-vllm's ``layers/linear.py``).

Each layer has ``weight_loader(param, loaded_weight, shard_id=None)``, which copies this rank's
slice of a full checkpoint tensor into one of its parameters. It is a method of the module,
not an attribute of the parameter as in nano-vllm: attributes set on a parameter are lost when
``to_empty`` materialises a model built on the ``meta`` device. Column-parallel layers split the
output features over the TP ranks (no communication); row-parallel ones split the input
features and sum the partial outputs with an all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from mm_serve.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from mm_serve.kernels import linear, silu_and_mul, silu_and_mul_linear


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the TP size {denominator}.")
    return numerator // denominator


def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` after checking shapes (a wrong config would otherwise broadcast)."""
    if dst.shape != src.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(src)


class LinearBase(nn.Module):
    """``y = x @ W.T + b`` with ``W: [output_size, input_size]`` of this rank's shard.

    A quantized layer (``quantization.quantize_layers``) has a ``quant_method`` and its
    parameters: every one has a row per output feature, so the weight loaders shard them all
    as the weight."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        # A quantization.QuantLinearMethod when quantized; a lora.layers.LoRALinearMethod
        # (wrapping the former) with LoRA. The fused norm/activation paths need it None.
        self.quant_method = None

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        return linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks: ``[.., input_size] -> [.., output_size / tp]``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, divide(output_size, get_tp_size()), bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        size = param.shape[0]
        copy_weight(param.data, loaded_weight.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_up_proj); ``shard_id`` is the index
    into ``output_sizes`` of the checkpoint tensor being loaded."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        assert isinstance(shard_id, int)
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        src = loaded_weight.narrow(0, self.tp_rank * size, size)
        copy_weight(param.data.narrow(0, offset, size), src)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul: ``[.., hidden] -> [.., (heads + 2 kv_heads) * d]``
    for this rank's heads; ``shard_id`` is ``"q"``, ``"k"`` or ``"v"``.

    With more ranks than KV heads, each KV head is replicated on ``tp / total_num_kv_heads``
    consecutive ranks (as vLLM does).
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
    ) -> None:
        tp_size, tp_rank = get_tp_size(), get_tp_rank()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.kv_shard_rank = tp_rank // divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
            self.kv_shard_rank = tp_rank
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        output_size = (self.q_size + 2 * self.kv_size) * tp_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        q, kv = self.q_size, self.kv_size
        offset, size, rank = {
            "q": (0, q, self.tp_rank),
            "k": (q, kv, self.kv_shard_rank),
            "v": (q + kv, kv, self.kv_shard_rank),
        }[shard_id]
        copy_weight(param.data.narrow(0, offset, size), loaded_weight.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split over ranks: ``[.., input_size / tp] -> [.., output_size]``, partial
    outputs summed over the group; the bias (full on every rank) is added once, after."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(divide(input_size, get_tp_size()), output_size, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if param.dim() == 1 or param.shape[1] == loaded_weight.shape[1] == 1:
            copy_weight(param.data, loaded_weight)  # bias, per-row scales: replicated
            return
        size = param.shape[1]
        copy_weight(param.data, loaded_weight.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """``gated``: ``x = [gate | up]`` and the input is ``silu(gate) * up`` (the gated MLP's
        activation, fused into the GEMV for one token)."""
        if self.quant_method is not None:
            y = tp_all_reduce(self.quant_method.apply(self, silu_and_mul(x) if gated else x, None))
        else:
            y = tp_all_reduce((silu_and_mul_linear if gated else linear)(x, self.weight))
        return y if self.bias is None else y + self.bias
