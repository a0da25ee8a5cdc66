"""What a request says about its adapter (vLLM's ``LoRARequest``) and the error of an adapter
that cannot be served. No torch here: the front end and the wire import it."""

from __future__ import annotations

from dataclasses import dataclass


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served: a missing or malformed folder, a rank above
    ``max_lora_rank``, target modules the engine does not serve, or tensors of another base
    model. The API answers it with a 400; nothing of the adapter stays loaded."""


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter for a request, with vLLM's fields.

    ``lora_int_id`` (>= 1) identifies the adapter inside the engine: the scheduler counts the
    distinct ids of a step, the GPU slots and the CPU cache hold adapters by id, and the
    prefix cache keys KV blocks on it. ``lora_path`` is the folder ``peft`` saved
    (``adapter_config.json``, ``adapter_model.safetensors``).

    Raises:
        ValueError: ``lora_int_id`` below 1, or an empty name or path.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, not {self.lora_int_id!r}.")
        if not self.lora_name or not self.lora_path:
            raise ValueError("A LoRARequest needs a lora_name and a lora_path.")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of ``lora_int_id``."""
        return self.lora_int_id
