"""The processor cache: mm_hash → preprocessed image, so that a repeated image skips the
preprocessing pool (decoding, resizing, normalising, patchifying).

Least recently used entries are evicted first, and the entries' total size is bounded in bytes.
Like vLLM's processor cache (vllm/multimodal/cache.py), it lives in the front end, in front of
the pool; the engine core keeps its own encoder cache of embeddings.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any


class ProcessorCache:
    """An LRU map from mm_hash to a preprocessed item, bounded by the items' size in bytes.

    Args:
        capacity_bytes: the most bytes the cached items may hold together; 0 turns the cache
            off (nothing is stored; lookups still count as queries).

    Thread-safe: the front end may look up and store from several threads.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must not be negative, got {capacity_bytes}.")
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0  # held by the cached items now
        self.queries = 0  # lookups since start-up
        self.hits = 0  # of those, lookups that found the item
        self._items: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # LRU first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, mm_hash: str) -> bool:
        """Whether ``mm_hash`` is cached; unlike ``get``, neither counted nor made recent."""
        return mm_hash in self._items

    def get(self, mm_hash: str) -> Any | None:
        """The cached item (now the most recently used), or None; counts a query and a hit."""
        with self._lock:
            self.queries += 1
            entry = self._items.get(mm_hash)
            if entry is None:
                return None
            self.hits += 1
            self._items.move_to_end(mm_hash)
            return entry[0]

    def put(self, mm_hash: str, item: Any, nbytes: int) -> None:
        """Store ``item`` of ``nbytes`` bytes as the most recently used entry, evicting the
        least recently used ones until it fits. An item larger than the capacity is not
        stored, nor anything when the cache is off; storing a hash again replaces its item."""
        if nbytes > self.capacity_bytes or self.capacity_bytes == 0:
            return
        with self._lock:
            old = self._items.pop(mm_hash, None)
            if old is not None:
                self.num_bytes -= old[1]
            while self.num_bytes + nbytes > self.capacity_bytes:
                _, (_, evicted_bytes) = self._items.popitem(last=False)
                self.num_bytes -= evicted_bytes
            self._items[mm_hash] = (item, nbytes)
            self.num_bytes += nbytes
