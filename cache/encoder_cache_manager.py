"""Scheduler-side bookkeeping of the encoder cache: which images' embeddings the runner holds.

The model runner keeps ``mm_hash -> [num_tokens, hidden]`` vision embeddings; this manager
decides what goes in and what comes out, in units of embedding tokens (no torch here). After
vLLM V1's ``EncoderCacheManager`` (vllm/v1/core/encoder_cache_manager.py):

- An entry is referenced by every request that still has tokens of that image to compute.
- When the last reference goes, the entry stays cached but becomes *freeable*; freeable entries
  are evicted oldest-first, and only when a new image needs their space. A later request with the
  same image takes the entry back (a hit: nothing is encoded again).
- Evicted mm_hashes are reported once through ``get_freed_mm_hashes()``; the scheduler passes
  them to the runner, which then drops the tensors.

Capacity is fixed at start-up (``SchedulerConfig.encoder_cache_size``), at least the largest
image, so any single image can always be cached once the others are released.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mm_serve.messages.request import Request


class EncoderCacheManager:
    """Ref-counted, size-bounded set of cached image embeddings.

    Args:
        cache_size: capacity in embedding tokens.

    Attributes:
        num_free_slots: tokens not held by any entry.
        num_freeable_slots: tokens that are free or held only by unreferenced entries.
        hits / misses: images found cached / allocated to be encoded (one per request and image).
        num_encoder_tokens: embedding tokens allocated to be encoded since start-up.
    """

    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        self.num_freeable_slots = cache_size
        # mm_hash -> ids of the requests that still need the entry (empty set: freeable).
        self.cached: dict[str, set[str]] = {}
        # Unreferenced entries, oldest first: mm_hash -> num_tokens.
        self.freeable: OrderedDict[str, int] = OrderedDict()
        self.freed: list[str] = []
        self.hits = 0
        self.misses = 0
        self.num_encoder_tokens = 0

    @property
    def usage(self) -> float:
        """The fraction of the cache that requests reference, 0..1 (0 for an empty cache)."""
        return 1.0 - self.num_freeable_slots / self.cache_size if self.cache_size else 0.0

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        """Whether image ``input_id`` of ``request`` is cached; if so ``request`` references it.

        A freeable entry taken back this way is no longer evictable.
        """
        mm_hash = request.mm_features[input_id].mm_hash
        refs = self.cached.get(mm_hash)
        if refs is None:
            return False
        if request.request_id not in refs:
            self.hits += 1
            if not refs:
                self.num_freeable_slots -= self.freeable.pop(mm_hash)
            refs.add(request.request_id)
        return True

    def can_allocate(self, num_tokens: int, compute_budget: int, num_tokens_pending: int) -> bool:
        """Whether an image of ``num_tokens`` fits this step, evicting freeable entries if needed.

        Args:
            num_tokens: the image's embedding tokens.
            compute_budget: encoder tokens still available this step.
            num_tokens_pending: tokens of images already chosen for the same request this step
                but not yet allocated.
        """
        if num_tokens > compute_budget:
            return False
        needed = num_tokens + num_tokens_pending
        if needed > self.num_freeable_slots:
            return False
        while needed > self.num_free_slots:
            mm_hash, size = self.freeable.popitem(last=False)
            del self.cached[mm_hash]
            self.freed.append(mm_hash)
            self.num_free_slots += size
        return True

    def allocate(self, request: Request, input_id: int) -> None:
        """Reserve space for image ``input_id`` of ``request``, to be encoded this step."""
        feature = request.mm_features[input_id]
        size = feature.placeholder.length
        self.cached.setdefault(feature.mm_hash, set()).add(request.request_id)
        self.num_free_slots -= size
        self.num_freeable_slots -= size
        self.misses += 1
        self.num_encoder_tokens += size

    def get_cached_input_ids(self, request: Request) -> list[int]:
        """Indices of ``request``'s images that it currently references."""
        return [
            i
            for i, feature in enumerate(request.mm_features)
            if request.request_id in self.cached.get(feature.mm_hash, ())
        ]

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        """Drop ``request``'s reference to image ``input_id``; unreferenced entries stay cached
        (freeable) until their space is needed."""
        feature = request.mm_features[input_id]
        refs = self.cached.get(feature.mm_hash)
        if not refs or request.request_id not in refs:
            return
        refs.remove(request.request_id)
        if not refs:
            self.freeable[feature.mm_hash] = feature.placeholder.length
            self.num_freeable_slots += feature.placeholder.length

    def free(self, request: Request) -> None:
        """Drop every reference of ``request`` (finished, aborted or preempted)."""
        for input_id in self.get_cached_input_ids(request):
            self.free_encoder_input(request, input_id)

    def get_freed_mm_hashes(self) -> list[str]:
        """The mm_hashes evicted since the last call (the runner frees their tensors)."""
        freed, self.freed = self.freed, []
        return freed
