"""The quantized linear layers' kernel choice per call: on CUDA the FP8 GEMMs (cuBLASLt's
scaled GEMM, ``torch._scaled_mm``, for per-token x per-channel scales and for 128 x 128 weight
blocks with 1 x 128 activation groups (rows padded to a multiple of 4, which that recipe
needs), bf16 out; else our Triton GEMM; W8A16 our Triton GEMV
for one token) and the Triton W4A16 GEMM (GEMV for one
token); the float32 references of
``quant_linear`` on the CPU and in ``ref`` mode. GPUs without FP8 tensor cores (before sm_89:
Ampere) multiply the dequantized FP8 weight in the activations' dtype (W8A16), said once in
the log. On CUDA each is an opaque custom op (``mm_serve::fp8_linear``,
``mm_serve::int4_linear``), so ``torch.compile`` and CUDA graphs take it as one node.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mm_serve.kernels.config import kernel_mode
from mm_serve.kernels.dispatch import _log_once
from mm_serve.kernels.quant_linear import fp8_linear_ref, int4_linear_ref


def _on_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and kernel_mode() != "ref"


@functools.lru_cache(maxsize=8)
def has_fp8_tensor_cores(device: torch.device) -> bool:
    """Compute capability 8.9 (Ada) or newer."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N, G] float32
    bias: torch.Tensor | None,  # [N]
    input_group_size: int | None,
    block_scales: torch.Tensor | None = None,  # [N / 128, K / 128] float32
) -> torch.Tensor:
    """``fp8_linear_ref``'s contract (``input_group_size``: 0 W8A16, None per token, else per
    token group), ``[..., N]`` in ``x.dtype``. ``block_scales``: the 128 x 128 blocks' scales
    once each (``weight_scale`` without its repeats), for cuBLASLt's block-scaled GEMM."""
    if not _on_kernels(x):
        return fp8_linear_ref(x, weight, weight_scale, bias, input_group_size)
    group = -1 if input_group_size is None else input_group_size  # custom ops take no None
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.ops.mm_serve.fp8_linear(x2, weight, weight_scale, bias, group, block_scales)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("mm_serve::fp8_linear", mutates_args=())
def _fp8_linear_op(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None, input_group_size: int, block_scales: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    from mm_serve.kernels import triton_quant_linear as tq

    if not has_fp8_tensor_cores(x.device):
        _log_once("No FP8 on %s: FP8 weights run dequantized to %s (W8A16).", x.device, x.dtype)
        return _dequantized_linear(x, weight, weight_scale, bias)
    if input_group_size == 0:  # W8A16
        if x.shape[0] == 1:
            return tq.fp8_gemv_triton(x, weight, weight_scale, bias)
        return _dequantized_linear(x, weight, weight_scale, bias)
    per_token = input_group_size < 0
    group = None if per_token else input_group_size
    if x.dtype != torch.bfloat16 or not (per_token or block_scales is not None):
        x_q, x_scale = tq.quantize_fp8_triton(x, group)
        return tq.fp8_linear_triton(x_q, x_scale, weight, weight_scale, bias, x.dtype)
    if per_token:  # cuBLASLt's row-wise recipe
        x_q, x_scale = tq.quantize_fp8_triton(x, group)
        scale_b = weight_scale.view(1, -1)
        return torch._scaled_mm(
            x_q, weight.t(), scale_a=x_scale, scale_b=scale_b, bias=bias, out_dtype=x.dtype
        )
    # cuBLASLt's 1 x 128 by 128 x 128 block recipe, which takes rows in fours
    rows = x.shape[0]
    x_q, x_scale = tq.quantize_fp8_triton(F.pad(x, (0, 0, 0, -rows % 4)), group)
    y = torch._scaled_mm(
        x_q, weight.t(), scale_a=x_scale, scale_b=block_scales.t(), out_dtype=x.dtype
    )[:rows]
    return y if bias is None else y + bias


@_fp8_linear_op.register_fake
def _(x, weight, weight_scale, bias, input_group_size, block_scales):
    return x.new_empty(x.shape[0], weight.shape[0])


def _dequantized_linear(x, weight, weight_scale, bias):
    """W8A16: the weight dequantized to ``x.dtype`` (scales over their groups of features)."""
    repeats = weight.shape[1] // weight_scale.shape[1]
    w = weight.to(x.dtype) * weight_scale.repeat_interleave(repeats, dim=1).to(x.dtype)
    return F.linear(x, w, bias)


def int4_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] int8, or [N, K / 2] uint8 (pack_int4, CUDA)
    scale: torch.Tensor,  # [N, K / group_size]
    zero_point: torch.Tensor | None,  # [N, K / group_size] int8
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """``int4_linear_ref``'s contract; the Triton GEMM on a packed CUDA weight."""
    if weight.dtype != torch.uint8 or not _on_kernels(x):
        if weight.dtype == torch.uint8:
            from mm_serve.kernels.quant_linear import unpack_int4

            weight = unpack_int4(weight, group_size)
        return int4_linear_ref(x, weight, scale, zero_point, group_size, bias)
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.ops.mm_serve.int4_linear(x2, weight, scale, zero_point, group_size, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("mm_serve::int4_linear", mutates_args=())
def _int4_linear_op(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
    group_size: int, bias: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    from mm_serve.kernels import triton_quant_linear as tq

    x = x.contiguous()
    launch = tq.int4_gemv_triton if x.shape[0] == 1 else tq.int4_linear_triton
    return launch(x, weight, scale, zero_point, group_size, bias)


@_int4_linear_op.register_fake
def _(x, weight, scale, zero_point, group_size, bias):
    return x.new_empty(x.shape[0], weight.shape[0])
