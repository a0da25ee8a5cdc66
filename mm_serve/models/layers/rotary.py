"""Rotary position embedding with a precomputed cos/sin table per position.

``get_rope`` reads the rope type from the HF config and matches the inverse-frequency math
of transformers' ``modeling_rope_utils`` for ``default``, ``linear``, ``dynamic`` and
``llama3``, plus multimodal RoPE (``mrope_section`` in the rope dict: Qwen2-VL, and Qwen3-VL
with ``mrope_interleaved``). The table
``cos_sin_cache`` is ``[max_position, head_dim]`` float32: the first half is
``cos(pos * inv_freq)``, the second ``sin``, times the attention factor.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from mm_serve.kernels import apply_mrotary

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


def rope_params_from_config(config: Any) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from a transformers 5 (``rope_parameters``, with
    ``rope_type`` and ``rope_theta`` inside) or 4.x (``rope_theta`` + ``rope_scaling``) config."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    base = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    return float(base), params or None


class RotaryEmbedding(nn.Module):
    """Default RoPE: ``inv_freq[i] = base ** (-2i / head_dim)``.

    ``forward(positions [T], query [T, H*d], key [T, H_kv*d]) -> (query, key)`` rotated (NeoX
    style). The table is a non-persistent buffer: after materialising a ``meta``-built model,
    call ``rebuild_buffers()``.
    """

    mrope_section: list[int] | None = None  # M-RoPE's split of the frequencies (subclass)
    mrope_interleaved = False  # M-RoPE's layout of that split: Qwen3-VL's interleaved one

    def __init__(self, head_dim: int, max_position: int, base: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.base = base
        self.attention_factor = 1.0  # HF applies none for the supported types (yarn would)
        self.register_buffer("cos_sin_cache", self._compute_cache(), persistent=False)

    def _inv_freq(self, base: float | torch.Tensor) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        return 1.0 / (base**exponents)  # [head_dim // 2]

    def _freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """``[P] -> [P, head_dim // 2]`` rotation angles."""
        return positions[:, None] * self._inv_freq(self.base)[None, :]

    def _compute_cache(self, device: torch.device | None = None) -> torch.Tensor:
        positions = torch.arange(self.max_position, dtype=torch.float32, device=device)
        freqs = self._freqs(positions)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.attention_factor

    def rebuild_buffers(self) -> None:
        """Recompute the table (on CPU, then moved) on the device the buffer lives on."""
        self.cos_sin_cache = self._compute_cache(torch.device("cpu")).to(self.cos_sin_cache.device)

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_write = (value, kv_cache, slot_mapping)``: also write the rotated key and the
        value to the cache (see ``apply_rotary``)."""
        return apply_mrotary(
            positions, query, key, self.cos_sin_cache, self.head_dim, self.mrope_section,
            kv_write, self.mrope_interleaved,
        )  # fmt: skip


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    """Position interpolation: ``inv_freq / factor`` (HF ``linear``)."""

    def __init__(self, head_dim: int, max_position: int, base: float, factor: float) -> None:
        self.factor = factor
        super().__init__(head_dim, max_position, base)

    def _inv_freq(self, base: float | torch.Tensor) -> torch.Tensor:
        return super()._inv_freq(base) / self.factor


class DynamicNTKRotaryEmbedding(RotaryEmbedding):
    """NTK-aware scaling (HF ``dynamic``): the base grows with the sequence length.

    HF recomputes ``inv_freq`` in each forward from that forward's largest position and
    applies it to *all* its positions, so its output depends on the batch. Here each position
    ``p >= original_max_position`` uses the ``inv_freq`` HF would use for a sequence ending at
    ``p`` (``seq_len = p + 1``) -- a pure function of the position, so cached keys stay valid.
    Positions inside the original window use the default ``inv_freq``, exactly as HF does.
    """

    def __init__(
        self, head_dim: int, max_position: int, base: float, factor: float, original: int
    ) -> None:
        self.factor, self.original = factor, original
        super().__init__(head_dim, max_position, base)

    def _freqs(self, positions: torch.Tensor) -> torch.Tensor:
        seq_len = torch.clamp(positions.double() + 1, min=self.original)
        dim = self.head_dim
        scale = (self.factor * seq_len / self.original - (self.factor - 1)) ** (dim / (dim - 2))
        base = (self.base * scale).float()[:, None]  # [P, 1]
        return positions[:, None] * self._inv_freq(base)


class Llama3RotaryEmbedding(RotaryEmbedding):
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, short ones kept, a smooth
    interpolation in between (HF ``_compute_llama3_parameters``)."""

    def __init__(self, head_dim: int, max_position: int, base: float, params: dict) -> None:
        self.factor = params["factor"]
        self.low_freq_factor = params["low_freq_factor"]
        self.high_freq_factor = params["high_freq_factor"]
        self.original = params["original_max_position_embeddings"]
        super().__init__(head_dim, max_position, base)

    def _inv_freq(self, base: float | torch.Tensor) -> torch.Tensor:
        inv_freq = super()._inv_freq(base)
        low_freq_wavelen = self.original / self.low_freq_factor
        high_freq_wavelen = self.original / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (M-RoPE, Qwen2-VL paper arXiv:2409.12191, section 2.1).

    Each token has three positions (temporal, height, width). The ``head_dim // 2`` rotary
    frequencies are split into ``mrope_section`` (e.g. ``[16, 24, 24]`` for head_dim 128,
    summing to ``head_dim // 2``); section ``i`` rotates by the position on axis ``i``. This is
    HF ``Qwen2VLRotaryEmbedding.recomposition_frequencies``. With ``interleaved`` (Qwen3-VL,
    ``mrope_interleaved`` in the rope dict) the three axes take turns over the frequencies
    instead (HF ``Qwen3VLTextRotaryEmbedding``; ``kernels.rotary.mrope_axes``).

    ``forward(positions, query, key)`` takes ``positions`` ``[3, T]`` (rows t, h, w), or ``[T]``
    when all three axes are equal (text, decode), which is plain RoPE.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        mrope_section: list[int],
        interleaved: bool = False,
    ) -> None:
        if len(mrope_section) != 3 or sum(mrope_section) != head_dim // 2:
            raise ValueError(
                f"mrope_section {mrope_section} must have 3 parts summing to head_dim // 2 = "
                f"{head_dim // 2}."
            )
        self.mrope_section = [int(n) for n in mrope_section]
        self.mrope_interleaved = bool(interleaved)
        super().__init__(head_dim, max_position, base)


def get_rope(
    head_dim: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None = None
) -> RotaryEmbedding:
    """The rotary module for a config's rope type.

    ``max_position`` is the config's ``max_position_embeddings``. For ``linear`` and
    ``dynamic`` that is the original window and the table covers ``max_position * factor``
    positions; for ``llama3`` it is already the extended length. A dict with ``mrope_section``
    gives ``MRotaryEmbedding`` (interleaved with a true ``mrope_interleaved``). Raises
    ``ValueError`` for other rope types (yarn, longrope, ...).
    """
    params = rope_scaling or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor < 1 is not supported.")
    if "mrope_section" in params:
        if rope_type not in ("default", "mrope"):
            raise ValueError(f"mrope with rope type {rope_type!r} is not supported.")
        interleaved = bool(params.get("mrope_interleaved", False))
        return MRotaryEmbedding(head_dim, max_position, base, params["mrope_section"], interleaved)
    if rope_type == "default":
        return RotaryEmbedding(head_dim, max_position, base)
    if rope_type == "linear":
        factor = params["factor"]
        return LinearScalingRotaryEmbedding(head_dim, int(max_position * factor), base, factor)
    if rope_type == "dynamic":
        factor = params["factor"]
        return DynamicNTKRotaryEmbedding(
            head_dim, int(max_position * factor), base, factor, max_position
        )
    if rope_type == "llama3":
        return Llama3RotaryEmbedding(head_dim, max_position, base, params)
    raise ValueError(
        f"Unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
    )
