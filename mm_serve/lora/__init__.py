"""Multi-LoRA serving: PEFT adapters on one base model, mixed in one batch.

- ``request``: ``LoRARequest`` (vLLM's) and ``LoRAAdapterError``;
- ``adapter``: reads a ``peft`` folder into our layers' layout (fused q/k/v and gate/up as
  slices), checking it against the model;
- ``layers``: the LoRA-wrapped linear layers and their GPU slots;
- ``manager``: the worker's slots for ``max_loras`` adapters and CPU LRU of ``max_cpu_loras``;
- ``registry``: the front end's check of an adapter before its first request.

The batched shrink and expand kernels are ``mm_serve.kernels.lora``.
"""

from mm_serve.lora.request import LoRAAdapterError, LoRARequest

__all__ = ["LoRAAdapterError", "LoRARequest"]
