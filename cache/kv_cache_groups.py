"""KV-cache groups: which layers share a block table, for models mixing sliding-window and
full-attention layers (Gemma 3: five sliding-window layers to one full one).

A full-attention layer keeps the KV of every token; a sliding-window layer of window ``W`` needs
only the last ``W - 1`` tokens' (HF: query ``q`` sees keys ``k > q - W``). As vLLM's hybrid KV
cache manager does, the layers are cut into groups of one attention type and of equal size
(the last group of a type padded): each group has its own block table (``block_table[g]``),
every block of the one pool has the memory of ``layers_per_group`` layers, and layer ``j`` of
every group uses the ``j``-th KV tensor. A block holds one group's tokens at a time, so
groups never overwrite each other; the sliding groups' blocks that fall out of every window
go back to the pool (``kv_cache_manager``, ``kv_cache_policies``).

Group size (vLLM's rule for ``n:1`` patterns): the smaller type's layer count, unless the
larger type has less than 1.25 times as many layers (then the larger count, one group per
type). Full-attention groups come first, so that group 0 is a full-attention one.

Models of one attention type (every other family) have one group of all layers: one block
table, one tensor per layer, exactly as without groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mm_serve.checkpoint.families import config_get, find_family

SLIDING = "sliding_attention"


@dataclass(frozen=True)
class KVCacheGroup:
    """``layers``: the model's layer indices in the group (the ``j``-th uses KV tensor ``j``);
    ``sliding_window``: their window in tokens, None for full attention."""

    layers: tuple[int, ...]
    sliding_window: int | None = None


@dataclass(frozen=True)
class KVCacheLayout:
    """The KV-cache groups of a model's layers (see the module doc)."""

    groups: tuple[KVCacheGroup, ...]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def layers_per_group(self) -> int:
        """KV tensors to allocate: one per layer position within a group."""
        return max(len(group.layers) for group in self.groups)

    def layer_slots(self) -> list[tuple[int, int]]:
        """``(group, tensor index)`` of each layer, in layer order."""
        slots = {}
        for g, group in enumerate(self.groups):
            for j, layer in enumerate(group.layers):
                slots[layer] = (g, j)
        return [slots[layer] for layer in sorted(slots)]


def single_group(num_layers: int) -> KVCacheLayout:
    """All layers in one full-attention group."""
    return KVCacheLayout((KVCacheGroup(tuple(range(num_layers))),))


def kv_cache_layout(hf_config: Any) -> KVCacheLayout:
    """The KV-cache groups of a checkpoint's LM: by ``layer_types`` and ``sliding_window`` of
    its text config where its family honours them (``ModelFamily.sliding_window``), else one
    group. Raises ``ValueError`` for ``layer_types`` of the wrong length."""
    text = config_get(hf_config, "text_config") or hf_config
    num_layers = config_get(text, "num_hidden_layers")
    family = find_family(hf_config)
    window = config_get(text, "sliding_window")
    types = config_get(text, "layer_types")
    if family is None or not family.sliding_window or window is None or types is None:
        return single_group(num_layers)
    if len(types) != num_layers:
        raise ValueError(f"{len(types)} layer_types for {num_layers} layers.")
    full = [i for i, kind in enumerate(types) if kind != SLIDING]
    sliding = [i for i, kind in enumerate(types) if kind == SLIDING]
    if not sliding:
        return single_group(num_layers)
    if not full:
        return KVCacheLayout((KVCacheGroup(tuple(sliding), int(window)),))
    small, large = sorted((len(full), len(sliding)))
    size = large if large < 1.25 * small else small

    def cut(layers: list[int], window: int | None) -> list[KVCacheGroup]:
        return [
            KVCacheGroup(tuple(layers[i : i + size]), window) for i in range(0, len(layers), size)
        ]

    return KVCacheLayout(tuple(cut(full, None) + cut(sliding, int(window))))
