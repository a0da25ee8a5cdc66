"""The linear layers' kernel choice per call (beside ``dispatch``, which holds the mode and the
other kernels): the one-token Triton GEMV (with the norm before it or the gated activation
fused), on Hopper the GEMM with the MLP's activation in its epilogue for large steps
(``triton_gemm``), and cuBLAS (``linear_ref``) otherwise; the references on the CPU.
"""

from __future__ import annotations

import torch

from mm_serve.kernels.activation import silu_and_mul_ref
from mm_serve.kernels.dispatch import kernel_mode, quick_gelu, rms_norm, silu_and_mul, use_kernels
from mm_serve.kernels.linear import linear_ref


def _gemv_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """One fp16/bf16 token on CUDA with a weight of its dtype (rows contiguous)."""
    same = weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype)
    one_token = x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.float16, torch.bfloat16)
    return one_token and same and weight.stride(-1) == 1 and use_kernels(x, weight)


def linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """``x @ weight.T + bias``: the Triton GEMV for one fp16/bf16 token on CUDA (it streams the
    weight faster than cuBLAS at one row), else ``linear_ref`` (cuBLAS on CUDA)."""
    if _gemv_fits(x, weight, bias):
        from mm_serve.kernels.triton_linear import gemv_triton

        return gemv_triton(x, weight, bias)
    return linear_ref(x, weight, bias)


# The fewest rows for which the fused GEMM (``triton_gemm``) beats cuBLAS plus the activation
# kernel (timed per row count on Hopper; BENCHMARKS.md). Below them the unfused pair is faster.
FUSED_MLP_MIN_ROWS = {"quick_gelu": 4096, "silu_and_mul": 1024}


def _fused_mlp_fits(x: torch.Tensor, weight: torch.Tensor, act: str) -> bool:
    """Whether ``triton_gemm`` serves this call: rows enough, an sm90+ GPU (TMA), fp16/bf16
    operands of one dtype, contiguous, with 16-byte row strides."""
    if x.dim() != 2 or x.shape[0] < FUSED_MLP_MIN_ROWS[act] or not use_kernels(x, weight):
        return False
    same = x.dtype == weight.dtype and x.dtype in (torch.float16, torch.bfloat16)
    aligned = x.shape[1] % 8 == 0 and weight.shape[0] % 16 == 0
    contiguous = x.is_contiguous() and weight.is_contiguous()
    return same and aligned and contiguous and torch.cuda.get_device_capability(x.device)[0] >= 9


def linear_quick_gelu(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """``quick_gelu(x @ weight.T + bias)``, ``[T, N]``: one GEMM with the activation in its
    epilogue (``triton_gemm``) for large ``T`` on Hopper, else cuBLAS and ``quick_gelu``."""
    if _fused_mlp_fits(x, weight, "quick_gelu"):
        from mm_serve.kernels.triton_gemm import QUICK_GELU, linear_act_triton

        return linear_act_triton(x, weight, bias, QUICK_GELU)
    return quick_gelu(linear_ref(x, weight, bias))


def linear_silu_and_mul(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [2 * I, K]: gate rows, then up rows
    bias: torch.Tensor | None = None,  # [2 * I]
) -> torch.Tensor:
    """``silu_and_mul(x @ weight.T + bias)``, ``[T, I]``: the gated MLP's first projection
    and activation, one GEMM with the activation in its epilogue (``triton_gemm``) for large
    ``T`` on Hopper, else cuBLAS and ``silu_and_mul``. Under ``torch.compile`` on CUDA it is
    the opaque ``mm_serve::linear_silu_and_mul`` (which chooses per call)."""
    if torch.compiler.is_compiling():
        if x.is_cuda and kernel_mode() != "ref":
            return torch.ops.mm_serve.linear_silu_and_mul(x, weight, bias)
        return silu_and_mul_ref(linear_ref(x, weight, bias))  # Inductor fuses the activation
    if _fused_mlp_fits(x, weight, "silu_and_mul"):
        from mm_serve.kernels.triton_gemm import SILU_AND_MUL, linear_act_triton

        return linear_act_triton(x, weight, bias, SILU_AND_MUL)
    return silu_and_mul(linear_ref(x, weight, bias))


@torch.library.custom_op("mm_serve::linear_silu_and_mul", mutates_args=())
def _linear_silu_and_mul_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return linear_silu_and_mul(x, weight, bias)


@_linear_silu_and_mul_op.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


def silu_and_mul_linear(
    x: torch.Tensor,  # [..., 2 * K]: gate | up
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """``linear(silu_and_mul(x), weight, bias)``; one GEMV kernel with the activation fused
    for one token (see ``linear``)."""
    if _gemv_fits(x, weight, bias):
        from mm_serve.kernels.triton_linear import gemv_triton

        return gemv_triton(x, weight, bias, gated=True)
    return linear_ref(silu_and_mul(x), weight, bias)


def rms_norm_linear(
    x: torch.Tensor,  # [T, K]
    residual: torch.Tensor | None,  # [T, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm linear: ``(linear(rms_norm(h)), h)`` with ``h = x + residual`` (``x`` when
    ``residual`` is None). One GEMV kernel with the norm fused for one token (see ``linear``),
    else ``rms_norm`` then ``linear``."""
    same = norm_weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
    if same and _gemv_fits(x, weight, bias):
        from mm_serve.kernels.triton_linear import MAX_NORM_FEATURES, rms_norm_gemv_triton

        if x.shape[-1] <= MAX_NORM_FEATURES:
            return rms_norm_gemv_triton(x, residual, norm_weight, eps, weight, bias)
    if residual is None:
        return linear(rms_norm(x, norm_weight, eps), weight, bias), x
    normed, residual = rms_norm(x, norm_weight, eps, residual)
    return linear(normed, weight, bias), residual
