"""The worker's adapters: ``max_loras`` GPU slots and a CPU LRU of ``max_cpu_loras`` loaded ones.

The model runner calls ``activate`` with the adapters of the step's requests (the scheduler
never schedules more than ``max_loras`` distinct ones): each one not in a slot is loaded (from
the CPU cache, else from its folder) into a free slot or the least recently used slot that
this step does not need. ``slot_of`` then gives each request's slot.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from mm_serve.config.lora import LoRAConfig
from mm_serve.lora.adapter import LoRAAdapter, ModelLoRATargets, load_adapter
from mm_serve.lora.layers import LoRAContext, LoRASlots, install_lora_layers
from mm_serve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    """LoRA layers installed on ``model`` (its weights loaded), with slots in ``model``'s
    dtype and device, and a token-slot buffer of ``max_num_tokens``."""

    def __init__(self, model: nn.Module, config: LoRAConfig, max_num_tokens: int) -> None:
        self.config = config
        param = next(model.parameters())
        self.targets = ModelLoRATargets.of(model)
        self.context = LoRAContext(max_num_tokens, param.device)
        self.slots = {
            name: LoRASlots(
                target, config.max_loras, config.max_lora_rank, param.dtype, param.device
            )
            for name, target in self.targets.targets.items()
        }
        install_lora_layers(model, self.targets, self.slots, self.context)
        # lora_int_id -> adapter / slot, least recently used first.
        self.cpu_cache: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()
        self.slot_of_id: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.tower_ids: set[int] = set()  # adapters in slots that target the tower

    def add_adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter of ``request`` in the CPU cache (read from its folder when absent, the
        least recently used one dropped when full).

        Raises:
            LoRAAdapterError: the adapter cannot be served (``adapter.load_adapter``).
        """
        adapter = self.cpu_cache.get(request.lora_int_id)
        if adapter is None:
            adapter = load_adapter(request, self.targets, self.config.max_lora_rank)
            while len(self.cpu_cache) >= self.config.max_cpu_loras:
                self.cpu_cache.popitem(last=False)
            self.cpu_cache[request.lora_int_id] = adapter
            logger.info("Loaded LoRA adapter %r (id %d)", request.lora_name, request.lora_int_id)
        self.cpu_cache.move_to_end(request.lora_int_id)
        return adapter

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter (CPU cache and slot); whether it was held."""
        held = self.cpu_cache.pop(lora_int_id, None) is not None
        self.tower_ids.discard(lora_int_id)
        return self.slot_of_id.pop(lora_int_id, None) is not None or held

    def activate(self, requests: Iterable[LoRARequest | None]) -> None:
        """Put the adapters of ``requests`` (None: the base model) in slots.

        Raises:
            RuntimeError: more than ``max_loras`` distinct adapters (the scheduler's bound).
        """
        wanted = {r.lora_int_id: r for r in requests if r is not None}
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(
                f"{len(wanted)} adapters in one step; max_loras is {self.config.max_loras}."
            )
        for lora_int_id, request in wanted.items():
            if lora_int_id in self.slot_of_id:
                self.slot_of_id.move_to_end(lora_int_id)
            else:
                self._load_into_slot(request, self._free_slot(wanted))

    def _free_slot(self, wanted: dict[int, LoRARequest]) -> int:
        """An empty slot, else that of the least recently used adapter not in ``wanted``."""
        taken = set(self.slot_of_id.values())
        free = [slot for slot in range(self.config.max_loras) if slot not in taken]
        if free:
            return free[0]
        victim = next(i for i in self.slot_of_id if i not in wanted)
        return self.slot_of_id.pop(victim)

    @torch.no_grad()
    def _load_into_slot(self, request: LoRARequest, slot: int) -> None:
        adapter = self.add_adapter(request)
        for name, slots in self.slots.items():
            slots.write(slot, adapter.layers.get(name))
        self.slot_of_id[request.lora_int_id] = slot
        if adapter.targets_tower:
            self.tower_ids.add(request.lora_int_id)
        else:
            self.tower_ids.discard(request.lora_int_id)

    def slot_of(self, request: LoRARequest | None) -> int:
        """The slot of an activated adapter, -1 for None."""
        return -1 if request is None else self.slot_of_id[request.lora_int_id]

    def tower_slot_of(self, request: LoRARequest | None) -> int:
        """The slot whose adapter the tower applies for ``request``'s images: -1 unless its
        adapter targets the tower or projector."""
        if request is None or request.lora_int_id not in self.tower_ids:
            return -1
        return self.slot_of(request)

    def set_token_slots(self, row_slots: np.ndarray, row_of_token: np.ndarray) -> None:
        """Each scheduled token's slot: ``row_slots [num_reqs]`` at ``row_of_token [T]``."""
        self.context.set_token_slots(row_slots[row_of_token])
