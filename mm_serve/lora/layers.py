"""LoRA on our linear layers: each target layer's slots and the wrappers that add the delta.

A target's slots (``LoRASlots``) hold ``max_loras`` adapters at once, ranks padded to
``max_lora_rank = R`` with zeros: ``lora_a [max_loras, S * R, in]`` (the ``S`` slices' A
matrices stacked along the rank, so one shrink serves a fused layer) and ``lora_b
[max_loras, out, R]`` (each slice's B in its own output rows). ``add_delta`` adds
``B_s (A_s x)`` of each token's slot to each output slice ``s`` (``kernels.lora``).

- The language model's ``LinearBase`` layers keep their modules: ``LoRALinearMethod`` wraps
  their linear method (plain or quantized), so every fused path that needs a plain weight
  (the norm or the activation in the GEMV) takes the unfused one, which calls it. The slot of
  each token is ``LoRAContext.token_slots``, set by the model runner every step.
- The vision tower's and projector's ``nn.Linear`` layers are replaced by ``LoRAVisionLinear``:
  a tower call encodes the images of one adapter (``LoRAContext.tower_slot``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from mm_serve.kernels import linear
from mm_serve.kernels.lora import lora_expand, lora_shrink
from mm_serve.lora.adapter import LoRATarget, ModelLoRATargets, SliceWeights


class LoRAContext:
    """The adapter slot of every token of the step (``-1``: none), in a buffer of
    ``max_num_tokens`` on the device, and of the images the tower encodes now."""

    def __init__(self, max_num_tokens: int, device: torch.device) -> None:
        self.token_slots = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device)
        self.tower_slot = -1

    def set_token_slots(self, slots: np.ndarray) -> None:
        """``slots [T]``: the step's tokens' slots; the rest of the buffer is set to -1."""
        num_tokens = len(slots)
        self.token_slots[:num_tokens].copy_(torch.from_numpy(slots.astype(np.int32)))
        self.token_slots[num_tokens:].fill_(-1)

    @contextmanager
    def tower(self, slot: int) -> Iterator[None]:
        """Encode images with the adapter in ``slot`` (-1: none) inside the block."""
        self.tower_slot = slot
        try:
            yield
        finally:
            self.tower_slot = -1


class LoRASlots:
    """The ``max_loras`` slots of one target layer (see the module doc for the shapes)."""

    def __init__(
        self,
        target: LoRATarget,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.rank = max_rank
        num_slices, out = len(target.slice_sizes), sum(target.slice_sizes)
        size = (max_loras, num_slices * max_rank, target.input_size)
        self.lora_a = torch.zeros(size, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, out, max_rank, dtype=dtype, device=device)
        offsets = np.cumsum((0, *target.slice_sizes[:-1])).tolist()
        self.slices = list(zip(offsets, target.slice_sizes, strict=True))  # (offset, size)

    def write(self, slot: int, weights: tuple[SliceWeights | None, ...] | None) -> None:
        """Put an adapter's weights of this layer in ``slot`` (None: it has none here, the
        slot adds zero)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for s, pair in enumerate(weights or ()):
            if pair is None:
                continue
            lora_a, lora_b = pair
            r, (offset, size) = lora_a.shape[0], self.slices[s]
            self.lora_a[slot, s * self.rank : s * self.rank + r].copy_(lora_a)
            self.lora_b[slot, offset : offset + size, :r].copy_(lora_b)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """``y [T, out] += B_s (A_s x)`` per slice for each token's slot ``indices [T]``; ``x``
        is ``[T, in]``. Returns ``y``."""
        buf = lora_shrink(x, self.lora_a, indices)  # [T, S * R]
        rank = self.rank
        for s, (offset, size) in enumerate(self.slices):
            lora_b = self.lora_b[:, offset : offset + size]
            lora_expand(buf[:, s * rank : (s + 1) * rank], lora_b, indices, y, offset)
        return y


class LoRALinearMethod:
    """A language-model layer's linear method with LoRA: ``base`` (a quantized layer's method,
    or None for the plain GEMM), then each token's adapter delta."""

    def __init__(self, base: object | None, slots: LoRASlots, context: LoRAContext) -> None:
        self.base, self.slots, self.context = base, slots, context

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:  # [T, in] -> [T, out]
        base = self.base
        y = linear(x, layer.weight, bias) if base is None else base.apply(layer, x, bias)
        return self.slots.add_delta(x, y, self.context.token_slots[: x.shape[0]])


class LoRAVisionLinear(nn.Module):
    """An ``nn.Linear`` of the vision tower or projector (``base_layer``) plus the delta of the
    adapter in ``context.tower_slot``: ``[N, in] -> [N, out]``."""

    def __init__(self, base_layer: nn.Linear, slots: LoRASlots, context: LoRAContext) -> None:
        super().__init__()
        self.base_layer, self.slots, self.context = base_layer, slots, context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        slot = self.context.tower_slot
        if slot < 0:
            return y
        indices = torch.full((x.shape[0],), slot, dtype=torch.int32, device=x.device)
        return self.slots.add_delta(x, y, indices)


def install_lora_layers(
    model: nn.Module, targets: ModelLoRATargets, slots: dict[str, LoRASlots], context: LoRAContext
) -> None:
    """Wrap every target layer of ``model`` (after its weights are loaded): the language
    model's get a ``LoRALinearMethod``, the tower's are replaced by ``LoRAVisionLinear``."""
    for name, target in targets.targets.items():
        module = model.get_submodule(name)
        if not target.tower:
            module.quant_method = LoRALinearMethod(module.quant_method, slots[name], context)
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, LoRAVisionLinear(module, slots[name], context))
