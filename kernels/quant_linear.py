"""Linear layers on quantized weights: references in float32, the layout of
``models.layers.quantization`` (rows are output features).

- FP8 (``fp8_linear_ref``): ``weight`` float8_e4m3fn ``[N, K]`` with float32 scales per row
  ``[N, 1]`` or per row and block of 128 input features ``[N, K / 128]`` (128 x 128 blocks with
  each block's scale repeated over its rows); W8A8 quantizes the activations to FP8 at run
  time per token (compressed-tensors' FP8_DYNAMIC, vLLM's dynamic FP8) or per token and group
  of 128 (blocks: DeepSeek-V3's recipe, transformers' fine-grained FP8), scale ``max|x| / 448``.
- INT4 W4A16 (``int4_linear_ref``): ``weight`` int8 ``[N, K]`` holding -8..7, a scale (and,
  asymmetric, a zero point) per row and group of ``group_size`` input features: ``w = (q - z)
  * s``, as compressed-tensors' ``pack-quantized`` and AWQ define it. On CUDA the weight is
  packed two to a byte (``pack_int4``) for the Triton GEMM.

Each computes the dequantized product in float32 and returns ``x``'s dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
_MIN_SCALE = torch.finfo(torch.float32).eps


def quantize_fp8_rows(
    x: torch.Tensor, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q, scale)``: ``x`` ``[..., K]`` as float8_e4m3fn and its float32 scale per row (a
    token; a weight's output channel) ``[..., 1]``, or per row and group of ``group_size``
    features ``[..., K / group_size]``: ``scale = max|x| / 448`` over the row (group), at least
    float32 eps; ``x ~ x_q * scale``."""
    xf = x.float()
    groups = xf.unflatten(-1, (-1, group_size or xf.shape[-1]))  # [..., G, K / G]
    scale = (groups.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    x_q = (groups / scale).clamp(-FP8_MAX, FP8_MAX).flatten(-2).to(FP8_DTYPE)
    return x_q, scale.squeeze(-1)


def fp8_linear_ref(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N, G] float32: G = 1 (per row) or K / 128 (blocks)
    bias: torch.Tensor | None = None,  # [N]
    input_group_size: int | None = 0,
) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W = weight * weight_scale`` (each scale over ``K / G`` input
    features of its row). ``input_group_size``: 0 leaves ``x`` as it is (W8A16); None
    quantizes it to FP8 per token first, an integer per token and group of that many
    features (W8A8; blocks). Returns ``[..., N]`` in ``x.dtype``."""
    xf = x.float()
    if input_group_size != 0:
        x_q, scale = quantize_fp8_rows(x, input_group_size)
        xf = (x_q.float().unflatten(-1, (scale.shape[-1], -1)) * scale.unsqueeze(-1)).flatten(-2)
    repeats = weight.shape[1] // weight_scale.shape[1]
    w = weight.float() * weight_scale.float().repeat_interleave(repeats, dim=1)
    y = xf @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def dequantize_int4(
    weight: torch.Tensor,  # [N, K] int8, -8..7
    scale: torch.Tensor,  # [N, K / group_size]
    zero_point: torch.Tensor | None,  # [N, K / group_size] int8, or None (symmetric)
    group_size: int,
) -> torch.Tensor:
    """``(weight - zero_point) * scale`` per group of ``group_size`` input features, float32
    ``[N, K]``."""
    w = weight.float()
    if zero_point is not None:
        w = w - zero_point.float().repeat_interleave(group_size, dim=1)
    return w * scale.float().repeat_interleave(group_size, dim=1)


def int4_linear_ref(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] int8
    scale: torch.Tensor,  # [N, K / group_size]
    zero_point: torch.Tensor | None,  # [N, K / group_size] int8 or None
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """``x @ dequantize_int4(...).T + bias``: ``[..., N]`` in ``x.dtype``."""
    y = x.float() @ dequantize_int4(weight, scale, zero_point, group_size).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def pack_int4(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """int8 ``[N, K]`` of -8..7 -> uint8 ``[N, K / 2]``: in each group of ``group_size``
    features, byte ``j`` holds feature ``j`` (low nibble) and ``j + group_size / 2`` (high
    nibble), each stored plus 8. ``group_size`` even, ``K`` a multiple of it."""
    rows, cols = weight.shape
    half = group_size // 2
    nibbles = (weight.to(torch.int16) + 8).to(torch.uint8).view(rows, cols // group_size, 2, half)
    return (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(rows, cols // 2)


def unpack_int4(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """``pack_int4``'s inverse: uint8 ``[N, K / 2]`` -> int8 ``[N, K]``."""
    rows = packed.shape[0]
    groups = packed.view(rows, -1, group_size // 2)
    nibbles = torch.stack((groups & 0xF, groups >> 4), dim=2)  # [N, K / group, 2, half]
    return (nibbles.to(torch.int16) - 8).to(torch.int8).reshape(rows, -1)


def quantize_weight(
    weight: torch.Tensor,  # [N, K] float
    weight_type: str,
    group_size: int | None = None,
    block_rows: int = 1,
    symmetric: bool = True,
) -> dict[str, torch.Tensor]:
    """A float weight in the quantized layout (``models.layers.quantization``), by absmax
    round-to-nearest (as llmcompressor's FP8 and RTN W4A16 schemes):

    - FP8 ("fp8"): per row (``group_size`` None), or per block of ``block_rows`` x
      ``group_size``; ``{"weight", "weight_scale"}``.
    - INT4 ("int4"): per row and group of ``group_size`` features; symmetric ``s = max|w| / 7``
      (clamped to -8..7), else ``s = (max - min) / 15`` with a zero point;
      ``{"weight", "weight_scale"[, "weight_zero_point"]}``."""
    w = weight.float()
    rows, cols = w.shape
    if weight_type == "fp8":
        if group_size is None:
            q, scale = quantize_fp8_rows(w)
            return {"weight": q, "weight_scale": scale}
        padded = F.pad(w, (0, 0, 0, -rows % block_rows))  # a last block of fewer rows
        blocks = padded.view(-1, block_rows, cols // group_size, group_size)
        scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=_MIN_SCALE)
        scale = scale.repeat_interleave(block_rows, dim=0)[:rows]  # [N, K / group]
        q = (w / scale.repeat_interleave(group_size, dim=1)).clamp(-FP8_MAX, FP8_MAX)
        return {"weight": q.to(FP8_DTYPE), "weight_scale": scale}
    groups = w.view(rows, cols // group_size, group_size)
    if symmetric:
        scale = (groups.abs().amax(dim=-1) / 7).clamp(min=_MIN_SCALE)
        zero = torch.zeros_like(scale)
    else:
        lo, hi = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=_MIN_SCALE)
        zero = (-8 - torch.round(lo / scale)).clamp(-8, 7)
    q = (torch.round(groups / scale[..., None]) + zero[..., None]).clamp(-8, 7)
    out = {"weight": q.to(torch.int8).view(rows, cols), "weight_scale": scale.to(weight.dtype)}
    if not symmetric:
        out["weight_zero_point"] = zero.to(torch.int8)
    return out
