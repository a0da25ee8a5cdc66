"""Multi-LoRA serving's limits (vLLM's ``--enable-lora`` flags)."""

from __future__ import annotations

from dataclasses import dataclass

# The ranks the slots may be padded to (vLLM's choices).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoRAConfig:
    """``max_loras`` adapters per step (their GPU slots), ranks up to ``max_lora_rank``, and
    ``max_cpu_loras`` adapters kept in host memory (at least ``max_loras``; an LRU).

    Raises:
        ValueError: a limit below 1, ``max_lora_rank`` not one of ``LORA_RANKS``, or
            ``max_cpu_loras`` below ``max_loras``.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, not {self.max_loras}.")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(
                f"max_lora_rank must be one of {LORA_RANKS}, not {self.max_lora_rank}."
            )
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras})."
            )
