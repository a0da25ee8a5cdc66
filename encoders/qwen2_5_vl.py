"""Qwen2.5-VL vision tower: the Qwen2-VL ViT with window attention, RMSNorm and a SwiGLU MLP.

Most blocks attend within windows of ``window_size`` pixels (``window_size // patch // merge``
merged tokens a side); those in ``fullatt_block_indexes`` over the whole frame. The patch rows
are permuted window by window after the patch embedding (whole merge windows together, so the
merger still sees ``merge**2`` consecutive rows), and the merged tokens are put back in input
order at the end. Parameter names equal HF ``Qwen2_5_VisionTransformerPretrainedModel``'s
(checkpoint ``visual.*``)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from mm_serve.encoders.qwen2_vl import (
    Qwen2VisionTransformer,
    TowerPlan,
    frame_bounds,
    rotary_cos_sin,
    to_window_order,
)
from mm_serve.kernels.dispatch import get_activation, silu_and_mul, varlen_segments
from mm_serve.kernels.rotary import vision_rotary
from mm_serve.utils.transfer import host_to_device


def window_index(
    grids: list[list[int]], merge: int, window_size: int, patch_size: int
) -> tuple[torch.Tensor, list[int]]:
    """The window order of the merged tokens and the window boundaries in patch rows.

    Returns ``(index, cu_window_seqlens)``: ``index: [num_patches // merge**2]`` long, where
    position ``j`` of the window-ordered sequence holds merged token ``index[j]`` of the input;
    ``cu_window_seqlens``: ``num_windows + 1`` boundaries in (unmerged) patch rows. Windows are
    listed image by image, frame by frame, row-major; edge windows are smaller (HF pads them,
    then drops the padding: same result).
    """
    side = window_size // merge // patch_size  # window side in merged tokens
    unit = merge * merge
    index, cu_window, offset = [], [0], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        tokens = torch.arange(t * gh * gw).view(t, gh, gw) + offset
        for frame in tokens:
            for y in range(0, gh, side):
                for x in range(0, gw, side):
                    window = frame[y : y + side, x : x + side].flatten()
                    index.append(window)
                    cu_window.append(cu_window[-1] + window.numel() * unit)
        offset += t * gh * gw
    return torch.cat(index), cu_window


# The MLP's hidden width is padded to a multiple of this (in elements): with HF's 3,420
# (Qwen2.5-VL-7B) the activations' rows are not 16-byte aligned, and cuBLAS then runs all three
# GEMMs with SM80 ``align2`` kernels at a fraction of a Hopper GPU's matmul rate.
HIDDEN_ALIGN = 64


class Qwen2_5_VisionMLP(nn.Module):
    """SwiGLU: ``down_proj(act(gate_proj(x)) * up_proj(x))``, ``[N, dim] -> [N, dim]``.

    gate and up run as one GEMM (``gate_up_proj``: ``[2 * padded, dim]``, gate rows first),
    the hidden width padded from ``hidden_dim`` to ``padded`` (``HIDDEN_ALIGN``) with zero
    rows, and ``down_proj`` (``[dim, padded]``) with zero columns: the padded channels are
    ``act(0) * 0 = 0`` and meet zero weights, so the output is that of the unpadded MLP.
    Checkpoints keep HF's ``gate_proj``/``up_proj``/``down_proj`` tensors: ``load_hf_tensor``
    (streaming loader) and ``load_state_dict`` (a pre-hook) place them.
    """

    def __init__(self, dim: int, hidden_dim: int, hidden_act: str) -> None:
        super().__init__()
        self.hidden_dim = hidden_dim
        self.padded = -(-hidden_dim // HIDDEN_ALIGN) * HIDDEN_ALIGN
        self.gate_up_proj = nn.Linear(dim, 2 * self.padded)
        self.down_proj = nn.Linear(self.padded, dim)
        self.hidden_act = hidden_act
        self.act = get_activation(hidden_act)
        self._register_load_state_dict_pre_hook(self._merge_hf_state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.hidden_act == "silu":
            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def _slot(self, local_name: str) -> tuple[str, tuple[slice, ...]] | None:
        """Where HF's tensor ``local_name`` goes: our parameter's name and the slice it fills
        (None for ``down_proj.bias``, which loads as it is)."""
        part, _, kind = local_name.partition(".")
        h, p = self.hidden_dim, self.padded
        if part == "gate_proj":
            return f"gate_up_proj.{kind}", (slice(0, h),)
        if part == "up_proj":
            return f"gate_up_proj.{kind}", (slice(p, p + h),)
        if local_name == "down_proj.weight":
            return local_name, (slice(None), slice(0, h))
        return None

    @torch.no_grad()
    def load_hf_tensor(self, local_name: str, tensor: torch.Tensor) -> str | None:
        """Copy HF's tensor ``local_name`` (``gate_proj.*``, ``up_proj.*``,
        ``down_proj.weight``) into its slice and zero the padding of the parameter written.
        Returns that parameter's local name, or None for any other name.

        Raises:
            ValueError: the tensor's shape is not that of the slice.
        """
        slot = self._slot(local_name)
        if slot is None:
            return None
        name, index = slot
        param = self.get_parameter(name)
        if param[index].shape != tensor.shape:
            raise ValueError(
                f"Cannot load {local_name!r}: shape {tuple(tensor.shape)}, expected "
                f"{tuple(param[index].shape)}"
            )
        param[index] = tensor
        h, p = self.hidden_dim, self.padded
        if name == "down_proj.weight":
            param[:, h:].zero_()
        else:
            param[h:p].zero_()
            param[p + h :].zero_()
        return name

    def _merge_hf_state(self, state_dict, prefix, *args) -> None:
        """``load_state_dict`` pre-hook: HF's three projections become the padded merged ones."""
        if prefix + "gate_proj.weight" not in state_dict:
            return
        merged = {name: torch.zeros_like(t) for name, t in self.state_dict().items()}
        merged["down_proj.bias"] = state_dict.pop(prefix + "down_proj.bias")
        for part in ("gate_proj", "up_proj", "down_proj"):
            for kind in ("weight", "bias") if part != "down_proj" else ("weight",):
                name, index = self._slot(f"{part}.{kind}")
                merged[name][index] = state_dict.pop(f"{prefix}{part}.{kind}")
        state_dict.update({prefix + name: t for name, t in merged.items()})


class Qwen2_5_VisionTransformer(Qwen2VisionTransformer):
    """The Qwen2.5-VL vision tower, from ``vision_config`` (``Qwen2_5_VLVisionConfig``).

    ``forward(pixel_values [num_patches, C*T*P*P], grid_thw [num_images, 3] long)
    -> [num_patches // spatial_merge_size**2, out_hidden_size]``, images concatenated in input
    order (same contract as ``Qwen2VisionTransformer``). Raises ``ValueError`` if ``grid_thw``
    does not fit.
    """

    def __init__(self, vision_config) -> None:
        cfg = vision_config
        dim = cfg.hidden_size
        mlp = functools.partial(Qwen2_5_VisionMLP, dim, cfg.intermediate_size, cfg.hidden_act)
        self._build(cfg, dim, cfg.out_hidden_size, mlp, rms_norm=True)
        self.patch_size = cfg.patch_size
        self.window_size = cfg.window_size
        self.fullatt_block_indexes = set(cfg.fullatt_block_indexes)

    def plan(self, grids: list[list[int]], device: torch.device, dense: bool = True) -> TowerPlan:
        """The host-side part of a forward (see ``Qwen2VisionTransformer.plan``): rotary tables
        in window order, the frame and window segments and the window order itself."""
        merge, dtype = self.spatial_merge_size, self.patch_embed.proj.weight.dtype
        cos, sin = rotary_cos_sin(grids, merge, self.head_dim, self.rope_theta, device)
        index, cu_window = window_index(grids, merge, self.window_size, self.patch_size)
        index = host_to_device(index, device)
        rotary = vision_rotary(
            to_window_order(cos, index, merge), to_window_order(sin, index, merge)
        )
        # Windows never cross a frame, so per-frame boundaries stay valid after the permutation.
        full = varlen_segments(frame_bounds(grids), device, dtype, dense)
        windows = varlen_segments(cu_window, device, dtype, dense)
        return TowerPlan(rotary, full, windows, index, torch.argsort(index))
