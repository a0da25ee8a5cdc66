"""The front end's side of LoRA: every adapter is checked once, before its first request goes to
the engine, and a request whose adapter changes image embeddings gets image hashes of its own.

The check reads the adapter against the model's LoRA-able layers (``ModelLoRATargets`` of the
model built on the ``meta`` device: no memory, no weights), so a bad adapter is a
``LoRAAdapterError`` at the call (a 400 from the server), not a failure inside the engine; the
engine's worker later loads the same folder with the same checks (``LoRAManager``).
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from mm_serve.config import ModelConfig
from mm_serve.config.lora import LoRAConfig
from mm_serve.lora.adapter import ModelLoRATargets, load_adapter
from mm_serve.lora.request import LoRAAdapterError, LoRARequest
from mm_serve.messages.request import MultiModalFeature


class LoRARegistry:
    """Adapters checked so far: ``lora_int_id -> (lora_path, targets the tower)``."""

    def __init__(self, model_config: ModelConfig, lora_config: LoRAConfig) -> None:
        self.model_config, self.lora_config = model_config, lora_config
        self._targets: ModelLoRATargets | None = None
        self._checked: dict[int, tuple[str, bool]] = {}
        self._lock = threading.Lock()  # a server checks from several threads

    def check(self, request: LoRARequest) -> bool:
        """Check ``request``'s adapter (once per id and path); whether it targets the vision
        tower or projector.

        Raises:
            LoRAAdapterError: the adapter cannot be served, or its id is taken by another path.
        """
        with self._lock:
            known = self._checked.get(request.lora_int_id)
            if known is not None:
                if known[0] != request.lora_path:
                    raise LoRAAdapterError(
                        f"lora_int_id {request.lora_int_id} is already the adapter at "
                        f"{known[0]!r}; give {request.lora_path!r} another id."
                    )
                return known[1]
            adapter = load_adapter(request, self._model_targets(), self.lora_config.max_lora_rank)
            self._checked[request.lora_int_id] = (request.lora_path, adapter.targets_tower)
            return adapter.targets_tower

    def forget(self, lora_int_id: int) -> None:
        """Drop an adapter (unloaded by the server): its id may name another path later."""
        with self._lock:
            self._checked.pop(lora_int_id, None)

    def _model_targets(self) -> ModelLoRATargets:
        if self._targets is None:
            from mm_serve.models.loader import get_model_class

            hf_config = self.model_config.hf_config
            with torch.device("meta"):
                self._targets = ModelLoRATargets.of(get_model_class(hf_config)(hf_config))
        return self._targets

    def features_for(
        self, features: list[MultiModalFeature], request: LoRARequest | None
    ) -> list[MultiModalFeature]:
        """``features`` as a request with adapter ``request`` sends them: with the adapter's id
        in each mm_hash when it targets the tower (its images' embeddings, encoder-cache
        entries and KV differ from the base model's), else unchanged.

        Raises:
            LoRAAdapterError: see ``check``.
        """
        if request is None or not self.check(request) or not features:
            return features
        salt = f":lora{request.lora_int_id}"
        return [dataclasses.replace(f, mm_hash=f.mm_hash + salt) for f in features]
